"""CUDA caching-allocator readings from `torch.cuda.memory_stats_as_nested_dict()` and `mem_get_info()`.

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
from . import PacedReadings, allocator, host

FREE_MAX_AGE = 1.0
"""Seconds a device-free reading (cudaMemGetInfo, a driver call) may be reused for."""


def _all(stats: Mapping[str, Any], name: str, which: str = "current") -> int:
    return stats.get(name, {}).get("all", {}).get(which, 0)


def memory_from_stats(
    stats: Mapping[str, Any], *, device: str, capacity: int | None, device_free: int | None, rss: int | None
) -> Memory:
    """A Memory reading from a `memory_stats_as_nested_dict()` dict (a recorded one in tests)."""
    return Memory(
        device=device,
        allocated=_all(stats, "allocated_bytes"),
        reserved=_all(stats, "reserved_bytes"),
        fragmented=_all(stats, "inactive_split_bytes"),
        peak=_all(stats, "allocated_bytes", "peak"),
        active=_all(stats, "active_bytes"),
        alloc_retries=stats.get("num_alloc_retries", 0),
        ooms=stats.get("num_ooms", 0),
        capacity=capacity,
        device_free=device_free,
        rss=rss,
    )


def memory_fraction(device: torch.device) -> float:
    """The allocator's per-process cap on `device` as a fraction of its memory. torch 2.13 (and the
    2.11 of the GPU image) read it back; an older torch has no getter, and no cap unless the
    script set one (which gputui then cannot see, and lifts to 1.0 at the end)."""
    get = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    return 1.0 if get is None else float(get(device))


class CudaProbe(PacedReadings):
    """Reads one CUDA device. The peak is reset at the first step start after each reading, so a
    reading's peak covers every step since the one before: steps read at most every STEP_READ_S
    (step_reading) lose no peak between readings.

    Every figure of a step comes from one `memory_stats_as_nested_dict()` call: `memory_stats()`
    (and `memory_allocated()`/`memory_reserved()`, which call it) flattens and sorts its ~120
    keys in Python each time, several times the cost (benchmarks/tool_costs.py measures both).

    `limit` (bytes) caps what this process may allocate, through `set_per_process_memory_fraction`:
    the allocator then raises OutOfMemoryError as a smaller GPU would. The cap is checked only when
    the allocator asks the device for a new segment, so the cache is emptied once it is set, and
    `over_limit` says what stays reserved past it (segments with live tensors); `close()` puts
    back the fraction that was there before, since torch keeps it for the rest of the process.
    """

    over_limit: dict[str, int] | None = None
    """{"limit", "reserved"} where this process held more than the cap once it was set."""

    def __init__(
        self, device: torch.device, tracker: Any = None, *, limit: int | None = None, nvml: Any = None
    ) -> None:
        self.device = device
        self.tracker = tracker
        self.nvml = nvml  # an NvmlView, or None
        self.name = torch.cuda.get_device_name(device)
        self.unreadable = allocator.unreadable()  # read as 0 without being counted: left None
        self.total = torch.cuda.mem_get_info(device)[1]
        self._room = (float("-inf"), 0, 0)  # when, device free, free + reserved then
        self._reset_due = True  # a reading took the peak: the next step starts a new one
        self.limit: int | None = None
        self._previous: float | None = None  # the fraction before ours, put back by close()
        if limit is not None:
            if limit > self.total:
                raise ValueError(f"gpu_memory_limit is larger than the device ({limit} > {self.total} bytes)")
            self._previous = memory_fraction(device)
            torch.cuda.set_per_process_memory_fraction(limit / self.total, device)
            self.limit = limit
            torch.cuda.empty_cache()  # cached blocks are reused without the cap's check
            reserved = self.reserved()
            if reserved > limit:
                self.over_limit = {"limit": limit, "reserved": reserved}

    def close(self) -> None:
        """The run ended: the cap this probe set is lifted (the fraction before it put back)."""
        if self._previous is not None:
            torch.cuda.set_per_process_memory_fraction(self._previous, self.device)
            self._previous = None

    def start_step(self) -> None:
        if self._reset_due:
            self._reset_due = False
            torch.cuda.reset_peak_memory_stats(self.device)

    def _stats(self) -> Mapping[str, Any]:
        return torch.cuda.memory_stats_as_nested_dict(self.device)

    def allocated(self) -> int:
        return _all(self._stats(), "allocated_bytes")

    def reserved(self) -> int:
        return _all(self._stats(), "reserved_bytes")

    def _read_room(self, reserved: int | None) -> tuple[float, int, int]:
        """Device free and what this process can have (free + its reserved), read at most every
        FREE_MAX_AGE seconds: the two at the same moment, so the sum holds while segments come and go."""
        now = time.monotonic()
        if now - self._room[0] > FREE_MAX_AGE:
            free = torch.cuda.mem_get_info(self.device)[0]
            held = self.reserved() if reserved is None else reserved
            self._room = (now, free, free + held)
        return self._room

    def capacity(self, reserved: int | None = None) -> int:
        """What this process can have: the device's free memory and the segments it holds (what
        other processes hold is not ours to take), at most the cap. The one capacity the panels,
        micro_batch="auto", the after-OOM pick and the ranks' exchange read."""
        room = self._read_room(reserved)[2]
        return room if self.limit is None else min(self.limit, room)

    def read(self) -> Memory:
        """A reading now, its peak that of the steps since the last reading (or the last reset)."""
        self._reset_due, self._step_read_at = True, float("-inf")  # what changed is shown after the next step
        stats = self._stats()
        reserved = _all(stats, "reserved_bytes")
        memory = memory_from_stats(
            stats,
            device=str(self.device),
            capacity=self.capacity(reserved),
            device_free=self._room[1],
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
        before = self.reserved()
        gc.collect()
        torch.cuda.empty_cache()
        after = self.reserved()
        self._step_read_at = float("-inf")  # the next step's reading shows what went
        return {"bytes": before - after, "reserved_before": before, "reserved_after": after}

    def after_oom(self, baseline: int) -> None:
        """The failed attempt's cycles (young objects) collected, and a full collection (~100 ms with
        torch loaded) only while more than `baseline` stays allocated; then the cache emptied."""
        gc.collect(1)
        if self.allocated() > baseline:
            gc.collect()
        torch.cuda.empty_cache()
        self._reset_due, self._step_read_at = True, float("-inf")  # the replay's peak is its own


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
