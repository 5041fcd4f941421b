"""CUDA caching-allocator readings from `torch.cuda.memory_stats()` and `mem_get_info()`."""

from __future__ import annotations

import gc
from typing import Any

import torch

from ..telemetry.sample import Memory
from . import host


class CudaProbe:
    """Reads one CUDA device; the step peak is reset at each step start."""

    def __init__(self, device: torch.device, tracker: Any = None) -> None:
        self.device = device
        self.tracker = tracker
        self.name = torch.cuda.get_device_name(device)
        _, self.total = torch.cuda.mem_get_info(device)

    def start_step(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def read(self) -> Memory:
        stats = torch.cuda.memory_stats(self.device)
        return Memory(
            device=str(self.device),
            allocated=stats.get("allocated_bytes.all.current", 0),
            reserved=stats.get("reserved_bytes.all.current", 0),
            fragmented=stats.get("inactive_split_bytes.all.current", 0),
            peak=stats.get("allocated_bytes.all.peak", 0),
            capacity=self.total,
            rss=host.rss(max_age=host.RSS_MAX_AGE),
            alloc_retries=stats.get("num_alloc_retries", 0),
            ooms=stats.get("num_ooms", 0),
            **(self.tracker.breakdown() if self.tracker is not None else {}),
        )

    def free_cache(self) -> dict[str, Any]:
        """gc, then return the allocator's unused cached blocks to the device."""
        before = torch.cuda.memory_reserved(self.device)
        gc.collect()
        torch.cuda.empty_cache()
        after = torch.cuda.memory_reserved(self.device)
        return {"bytes": before - after, "reserved_before": before, "reserved_after": after}
