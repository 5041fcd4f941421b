"""The latest plan as the screen reads it (a RunView's `plan` event): its rows, whether it was made for the
setting the run has now, and the row a remedy key would lead to."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..telemetry.describe import plan_rows
from ..units import format_pieces
from .keys import BY_KEY
from .view import RunView


def options(v: RunView) -> list[Mapping[str, Any]]:
    """The latest plan's rows (empty before any; a malformed one skipped)."""
    return plan_rows(v.plan) if v.plan else []


def pieces(o: Mapping[str, Any], *, compact: bool = False) -> str:
    """A row's micro-batches as they add up ("5 × 6 + 2", not "5 × 7": the last piece of an uneven cut is
    smaller; `compact`: a remedy chip's "5×6+2"); "m × accumulation" from a plan of a gputui that did not
    send its batch."""
    m, n, total = o.get("micro_batch"), o.get("accumulation"), o.get("batch_size")
    if isinstance(m, int) and isinstance(n, int) and isinstance(total, int):
        text = format_pieces(m, n, total, spaced=True, sums=False)
    else:
        text = f"{m if m is not None else '?'} × {n if n is not None else '?'}"
    return text.replace(" ", "") if compact else text


def option(v: RunView, remedy: str) -> Mapping[str, Any] | None:
    return next((o for o in options(v) if o.get("remedy") == remedy), None)


def fresh(v: RunView) -> bool:
    """The plan was made for the settings the run has now (its "now" row's): a stale plan's predictions
    are no longer the keys' (each option's settings are absolute)."""
    now = option(v, "now")
    return (
        now is not None
        and v.micro_batch is not None
        and (now.get("micro_batch"), now.get("amp"), now.get("checkpointing"))
        == (v.micro_batch, v.amp, v.checkpointing)
    )


def predicted(v: RunView, key: str) -> Mapping[str, Any] | None:
    """The row a remedy key (b, B, a, c) would lead to, from a fresh plan; `a`'s is the mode it switches to."""
    remedy = BY_KEY[key].remedy if key in BY_KEY else None
    if not fresh(v) or remedy is None:
        return None
    amp = v.next_amp()
    rows = (o for o in options(v) if o.get("remedy") == remedy)
    return next((o for o in rows if remedy != "amp" or o.get("amp") == amp), None)
