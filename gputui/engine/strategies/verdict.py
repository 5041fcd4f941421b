"""The synced backward's verdict under DDP: whether any rank's failed, carried on DDP's own last
gradient bucket (no collective of its own), and what a rank needs to rescue the others from its
failure (which parameters' gradients DDP took already, which ones the failed graph reaches)."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

MASKED_RANKS = 62  # the int64 verdict of a script's DDP names the failing ranks below this one


def rank_bits(dtype: torch.dtype) -> int:
    """How many ranks a verdict in `dtype` can name, one bit each: summed powers of two stay exact up to
    the mantissa's width (fp16's 1 << 16 would be inf, and 1 << 11 no longer exact)."""
    if not dtype.is_floating_point:
        return MASKED_RANKS
    return min(round(-math.log2(torch.finfo(dtype).eps)) + 1, MASKED_RANKS)


class Verdict:
    """This rank's verdict on its synced backward (failed, cannot go on, its bit) and every rank's
    summed, as fit's DDP comm hook carries them; nothing else, so nothing leads back to the wrapper.
    The summed verdict lives in a buffer of the bucket's dtype and device made once, so a step copies
    nothing to the device for it."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._buffers: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
        self.clear()

    def clear(self) -> None:
        self.mine = [0, 0, 0]
        self.sent = False  # the step's last bucket went out, carrying `mine`
        self.summed: torch.Tensor | None = None
        self.bits = MASKED_RANKS  # the ranks `summed` can name

    def filled(self, like: torch.Tensor) -> torch.Tensor:
        """`mine` in the buffer of `like`'s dtype and device: zeroed, or set element by element (a fill
        each, no copy from the host) on a failure, the rank's bit only where the dtype holds it."""
        key = (like.dtype, like.device)
        buffer = self._buffers.get(key)
        if buffer is None:
            buffer = self._buffers[key] = torch.zeros(3, dtype=like.dtype, device=like.device)
        self.bits = rank_bits(like.dtype)
        buffer.zero_()
        failed, fatal, bit = self.mine
        if failed:
            buffer[0], buffer[1] = 1, fatal
            if 0 < bit < 1 << self.bits:
                buffer[2] = bit
        return buffer


def with_verdict(v, bucket):
    """DDP's all-reduce of a bucket (the mean over the ranks, in place as its default hook), and on the
    step's last bucket each rank's verdict on its synced backward, summed by an all_reduce of its own
    issued with it (no bucket-sized copy to append it). Unannotated: DDP compares the annotations
    with its own types, and here they would be strings."""
    if not bucket.is_last():
        return default_hooks.allreduce_hook(None, bucket)  # type: ignore[arg-type]
    buffer = bucket.buffer()
    v.sent = True
    verdict = v.filled(buffer)
    summed = dist.all_reduce(buffer.div_(v.world_size), async_op=True).get_future()
    said = dist.all_reduce(verdict, async_op=True).get_future()

    def both(done: torch.futures.Future[list[torch.futures.Future[Any]]]) -> torch.Tensor:
        done.value()  # raises the error of either
        v.summed = verdict
        return summed.value()[0]

    return torch.futures.collect_all([summed, said]).then(both)


def arrival(arrived: set[int], index: int) -> Any:
    def hook(grad_inputs: Any, grad_outputs: Any) -> None:
        arrived.add(index)

    return hook


def tensors(output: Any) -> list[torch.Tensor]:
    """The tensors in a forward's output (a tensor, or containers of them, as DDP finds them)."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (list, tuple)):
        return [t for item in output for t in tensors(item)]
    return []


def reachable(roots: list[torch.Tensor]) -> set[int]:
    """The ids of the leaves the roots' graph accumulates into (its edges outlive a failed backward)."""
    found: set[int] = set()
    seen: set[Any] = set()
    stack = [root.grad_fn for root in roots]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None:
            found.add(id(variable))
        stack.extend(next_node for next_node, _ in node.next_functions)
    return found
