"""Host readings through psutil: this process's resident memory and the system's."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import time

import psutil

from ..telemetry.sample import HostReading

HOST_INTERVAL = 1.0
"""Seconds between full host readings (read_host) in a training loop."""

RSS_MAX_AGE = 0.2
"""Seconds a per-step RSS reading may be reused for."""

_process: psutil.Process | None = None
_last = (0.0, 0)  # (monotonic time, rss) of the last reading


def _forget() -> None:
    """In a forked child: its own process to read, not its parent's (and no parent's reading reused)."""
    global _process, _last
    _process, _last = None, (0.0, 0)


os.register_at_fork(after_in_child=_forget)


def rss(max_age: float = 0.0) -> int:
    """Resident set size of this process in bytes.

    A reading costs about 20 us (a /proc read); the per-step probes pass `max_age` so a loop of
    millisecond steps reads it a few times a second rather than every step (then it costs a clock
    read: a fork is noticed by the fork hook, not by a getpid() a step).
    """
    global _process, _last
    now = time.monotonic()
    if max_age and now - _last[0] < max_age and _process is not None:
        return _last[1]
    if _process is None:
        _process = psutil.Process()
    _last = (now, _process.memory_info().rss)
    return _last[1]


def read_host() -> HostReading:
    """RSS, this process's CPU use since the last call, and system memory (about 50 us)."""
    rss()  # makes _process for this pid
    assert _process is not None
    with _process.oneshot():
        memory = _process.memory_info()
        cpu = _process.cpu_percent(None)  # since the previous call; the first call says 0.0
    system = psutil.virtual_memory()
    return HostReading(
        rss=memory.rss, cpu_percent=cpu, system_used=system.total - system.available, system_total=system.total
    )


def _load_malloc_trim():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


_malloc_trim = _load_malloc_trim()


def release_free_memory() -> tuple[int, int]:
    """The CPU's "free the cache": collect garbage and hand free heap pages back to the OS.

    Returns (rss before, rss after). glibc keeps freed memory in its arenas the way the CUDA
    allocator keeps freed blocks; malloc_trim(0) is what returns it.
    """
    before = rss()
    gc.collect()
    if _malloc_trim is not None:
        _malloc_trim(0)
    return before, rss()
