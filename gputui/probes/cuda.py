"""CUDA caching-allocator readings from `torch.cuda.memory_stats()` and `mem_get_info()`.

The figures mean what `torch.cuda.memory_summary()` means by them: allocated (live tensors),
reserved (segments the allocator holds), fragmented (inactive split blocks: freed pieces of
segments still partly in use, which empty_cache() cannot return), the step's peak, and the
allocator's retries (it freed its cache and tried again: the sign of thrashing) and OOMs.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch

from ..telemetry.sample import Memory
from . import allocator, host

FREE_MAX_AGE = 1.0
"""Seconds a device-free reading (cudaMemGetInfo, a driver call) may be reused for."""


def memory_from_stats(
    stats: Mapping[str, int], *, device: str, capacity: int | None, device_free: int | None, rss: int | None
) -> Memory:
    """A Memory reading from a `memory_stats()` dict (a recorded one in tests)."""
    return Memory(
        device=device,
        allocated=stats.get("allocated_bytes.all.current", 0),
        reserved=stats.get("reserved_bytes.all.current", 0),
        fragmented=stats.get("inactive_split_bytes.all.current", 0),
        peak=stats.get("allocated_bytes.all.peak", 0),
        active=stats.get("active_bytes.all.current", 0),
        alloc_retries=stats.get("num_alloc_retries", 0),
        ooms=stats.get("num_ooms", 0),
        capacity=capacity,
        device_free=device_free,
        rss=rss,
    )


class CudaProbe:
    """Reads one CUDA device; the step peak is reset at each step start.

    `limit` (bytes) caps what this process may allocate, through
    `set_per_process_memory_fraction`: the allocator then raises OutOfMemoryError as a smaller
    GPU would, and the panels take the limit as the capacity.
    """

    def __init__(
        self, device: torch.device, tracker: Any = None, *, limit: int | None = None, nvml: Any = None
    ) -> None:
        self.device = device
        self.tracker = tracker
        self.nvml = nvml  # an NvmlView, or None
        self.name = torch.cuda.get_device_name(device)
        self.unreadable = allocator.unreadable()  # read as 0 without being counted: left None
        free, self.total = torch.cuda.mem_get_info(device)
        self._free = (time.monotonic(), free)
        self.limit = None
        if limit is not None:
            if limit > self.total:
                raise ValueError(f"gpu_memory_limit is larger than the device ({limit} > {self.total} bytes)")
            torch.cuda.set_per_process_memory_fraction(limit / self.total, device)
            self.limit = limit

    def start_step(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def _device_free(self) -> int:
        now = time.monotonic()
        if now - self._free[0] > FREE_MAX_AGE:
            self._free = (now, torch.cuda.mem_get_info(self.device)[0])
        return self._free[1]

    def read(self) -> Memory:
        memory = memory_from_stats(
            torch.cuda.memory_stats(self.device),
            device=str(self.device),
            capacity=self.limit or self.total,
            device_free=self._device_free(),
            rss=host.rss(max_age=host.RSS_MAX_AGE),
        )
        extra: dict[str, Any] = dict.fromkeys(self.unreadable)
        if self.tracker is not None:
            extra.update(self.tracker.breakdown())
        if self.nvml is not None:
            extra.update(self.nvml.used())
        return replace(memory, **extra) if extra else memory

    def free_cache(self) -> dict[str, Any]:
        """gc, then return the allocator's unused cached blocks to the device."""
        before = torch.cuda.memory_reserved(self.device)
        gc.collect()
        torch.cuda.empty_cache()
        after = torch.cuda.memory_reserved(self.device)
        return {"bytes": before - after, "reserved_before": before, "reserved_after": after}

    def after_oom(self, baseline: int) -> None:
        """The failed attempt's cycles (young objects) collected, and a full collection (~100 ms with
        torch loaded) only while more than `baseline` stays allocated; then the cache emptied."""
        gc.collect(1)
        if torch.cuda.memory_allocated(self.device) > baseline:
            gc.collect()
        torch.cuda.empty_cache()


class NvmlView:
    """What NVML says of this process and its device, from the latest reading the hub carries (no
    NVML call on the training thread: the poller thread makes them, probes.nvml.feed)."""

    def __init__(self, hub: Any, nvml_index: int, pid: int) -> None:
        self.hub, self.index, self.pid = hub, nvml_index, pid

    def used(self) -> dict[str, int | None]:
        from .nvml import process_gpu_memory

        reading = self.hub.gpus
        if reading is None or reading.status is not None:
            return {}
        device = next((d for d in reading.devices if d.index == self.index), None)
        if device is None:
            return {}
        mine = process_gpu_memory(reading, self.pid, self.index)
        # Containers hide PIDs from NVML: then only the device's "used" is known, and it is named so.
        return {"nvml_used": mine, "nvml_device_used": device.memory_used}
