"""The one micro-batch loop: every piece of a global batch forward and backward on its weighted loss,
as fit runs it on one process, under DDP and under FSDP (each strategy says how a piece is synced
and weighted)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from .microbatch import batch_size

_UNSYNCED = nullcontext()


def unsynced(last: bool) -> AbstractContextManager[Any]:
    return _UNSYNCED


@dataclass
class Progress:
    """Where a step is, for whoever handles an error out of it: its phase (forward, backward)."""

    phase: str = "forward"


def run_pieces(
    pieces: Sequence[Any],
    counts: Sequence[int],
    units: int,
    forward: Callable[[Any], torch.Tensor],
    backward: Callable[[torch.Tensor], None],
    weight: Callable[[int], float],
    *,
    sync: Callable[[bool], AbstractContextManager[Any]] = unsynced,
    skip_empty: bool = True,
    hold_last: bool = False,
    after: Callable[[], None] | None = None,
    at: Progress | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Forward each piece, then backward on `loss * weight(n)` (n: the piece's count, of `units`).
    `sync(last)`: the context a piece runs in (DDP's no_sync but for the last, FSDP's gradient sync);
    `skip_empty`: a piece of no items is not run (its mean over nothing would be NaN); one that runs (a
    held last one, or any where the strategy's passes are collectives) runs at weight 0 on another piece's
    data; `hold_last`: the last piece is forwarded, not backwarded, and its loss returned (DDP: its synced
    backward waits for the exchange); `after`: once a piece's backward is done. Returns this rank's mean
    loss over the pieces run (float32, out of the graph), and the held loss."""
    at = at if at is not None else Progress()
    last = len(pieces) - 1
    loss_sum = None
    for i, piece in enumerate(pieces):
        n = counts[i]
        if not n:
            if skip_empty and (i < last or not hold_last):  # a held last piece syncs: it runs
                continue
            # It runs for its collectives, at weight 0: on the smallest piece with items (no higher a peak than
            # the pieces'), since a loss that is a mean over no items is NaN (0/0), and so is its gradient
            piece = min((p for p, c in zip(pieces, counts, strict=True) if c), key=batch_size, default=piece)
        with sync(i == last):
            at.phase = "forward"
            loss = forward(piece)
            if hold_last and i == last:
                return loss_sum, loss
            at.phase = "backward"
            backward(loss * weight(n))
        if after is not None:
            after()
        mean = loss.detach().float() * (n / units if units else 0.0)
        loss_sum = mean if loss_sum is None else loss_sum + mean
    return loss_sum, None
