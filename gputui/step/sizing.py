"""The micro-batch's size rules, in one place: its floor, halving, doubling, and how a global batch
is cut. OOM recovery, the controls, thrashing, the exchange's prevention and the planner all ask
these, so a halving means the same everywhere."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..telemetry.controls import BATCH_NORM_FLOOR
from .microbatch import sizes, split


@dataclass(frozen=True)
class Sizing:
    floor: int = 1
    """The smallest micro-batch: 2 for a model with BatchNorm (one sample has no variance)."""

    def halved(self, size: int) -> int:
        return max(size // 2, self.floor)

    def doubled(self, size: int, total: int) -> int:
        return min(size * 2, total)

    def can_halve(self, size: int) -> bool:
        return size > max(1, self.floor)

    def why_not_halve(self, size: int) -> str | None:
        """Why a micro-batch of `size` cannot be halved, or None."""
        if size <= 1:
            return "the micro-batch is already 1"
        if size <= self.floor:
            return BATCH_NORM_FLOOR
        return None

    def cut(self, total: int, size: int) -> list[int]:
        """The pieces' sizes: `size` each, the rest last (one below the floor joins the piece before)."""
        return sizes(total, size, self.floor)

    def accumulation(self, total: int, size: int) -> int:
        return len(self.cut(total, size))

    def split(self, batch: Any, size: int, total: int) -> list[Any]:
        return split(batch, size, total, self.floor)
