"""Apple MPS readings: what PyTorch's MPS allocator holds and what the Metal driver has given it."""

from __future__ import annotations

import gc
from typing import Any

import torch

from ..telemetry.sample import Memory
from . import host


class MpsProbe:
    name = "Apple MPS"
    over_limit: dict[str, int] | None = None

    def __init__(self, device: torch.device, tracker: Any = None) -> None:
        self.device = device
        self.tracker = tracker
        self.total = torch.mps.recommended_max_memory() if hasattr(torch.mps, "recommended_max_memory") else None

    start_step = None  # nothing to reset at a step's start

    def allocated(self) -> int:
        return torch.mps.current_allocated_memory()

    def capacity(self) -> int | None:
        return self.total

    def read(self) -> Memory:
        return Memory(
            device="mps",
            allocated=torch.mps.current_allocated_memory(),
            reserved=torch.mps.driver_allocated_memory(),
            capacity=self.capacity(),
            rss=host.rss(max_age=host.RSS_MAX_AGE),
            **(self.tracker.breakdown() if self.tracker is not None else {}),
        )

    def step_reading(self, now: float) -> Memory:
        return self.read()  # two counters: no cost to save

    def free_cache(self) -> dict[str, Any]:
        before = torch.mps.driver_allocated_memory()
        gc.collect()
        torch.mps.empty_cache()
        after = torch.mps.driver_allocated_memory()
        return {"bytes": before - after, "reserved_before": before, "reserved_after": after}

    def after_oom(self, baseline: int) -> None:
        """As CudaProbe.after_oom()."""
        gc.collect(1)
        if torch.mps.current_allocated_memory() > baseline:
            gc.collect()
        torch.mps.empty_cache()

    def close(self) -> None:
        """No cap to lift on MPS."""
