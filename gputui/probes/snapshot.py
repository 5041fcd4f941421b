"""CUDA memory snapshots: the allocator's history as a pickle that pytorch.org/memory_viz opens,
and `torch.cuda.memory_summary()` as text beside it.

History is recorded with Python stacks only: torch's default adds C++ frames, "several KB" an
entry, which are symbolized when the snapshot is taken (the slow part of a dump). It is recorded
for at most MAX_ENTRIES events, and stopped when the run that started it ends: never the
recording a script started itself, which gputui neither changes nor stops.

The dump runs on the training thread, and stays there: at an OOM the snapshot must be taken while
the failed step's tensors are alive (the next thing the loop does is free them), and what costs
is turning the allocator's record into Python objects and pickling them, which hold the GIL
throughout, so a writer thread would give the training thread no time back. Its seconds are in
the `snapshot_saved` event (benchmarks/tool_costs.py measures them on CUDA).
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from ..telemetry.controls import SNAPSHOT_NEEDS_CUDA
from ..telemetry.run import launched_rank
from . import allocator

MAX_ENTRIES = 50_000
"""Allocation events kept (a ring: the newest win). A tensor costs about three (alloc,
free_requested, free_completed: torch's TraceEntry), so this is ~16,000 tensors: the failing step
and the steps before it for a model whose step allocates a few thousand, which is what an OOM's
story needs. At the ~1-2 KB an entry we expect with Python stacks (torch says "several KB" with
C++ frames) a dump stays in the tens of MB, which memory_viz opens; benchmarks/tool_costs.py
measures the bytes and seconds of a dump on CUDA."""

_owner: object | None = None
"""The run that started the recording (it stops it); None when gputui records nothing."""


def unavailable(device: torch.device) -> str | None:
    """Why snapshots and history cannot be had on `device` (None: they can)."""
    if device.type != "cuda":
        return SNAPSHOT_NEEDS_CUDA
    return allocator.history_unavailable()


def recording() -> bool:
    """Whether the allocator records history now, whoever started it."""
    enabled = getattr(torch._C, "_cuda_isHistoryEnabled", None)  # as torch's own cudagraph_trees asks
    return bool(enabled()) if enabled is not None else _owner is not None


def start_history(owner: object) -> None:
    """Record every allocation with its Python stack from now on (~2 us an allocation, torch says),
    unless something records already: then its settings stay, and so does who stops it."""
    global _owner
    if not recording():
        torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES, stacks="python")
        _owner = owner


def stop_history(owner: object) -> None:
    """The end of `owner`'s run: stop the recording if that run started it."""
    global _owner
    if _owner is owner and owner is not None:
        _owner = None
        torch.cuda.memory._record_memory_history(enabled=None)


def dump(folder: str, device: torch.device, *, step: int, reason: str) -> dict[str, Any]:
    """Write the snapshot and the summary under `folder`; returns the paths and the seconds it took."""
    os.makedirs(folder, exist_ok=True)
    rank = launched_rank()  # under torchrun every rank writes its own, into one folder
    who = f"{os.getpid()}" if rank is None else f"rank{rank}-{os.getpid()}"
    stem = os.path.join(os.path.abspath(folder), f"snapshot-{who}-step{step}-{reason}-{time.strftime('%Y%m%d-%H%M%S')}")
    pickle_path, text_path = stem + ".pickle", stem + ".txt"
    history = recording()
    t0 = time.perf_counter()
    torch.cuda.memory._dump_snapshot(pickle_path + ".tmp")
    os.replace(pickle_path + ".tmp", pickle_path)
    with open(text_path + ".tmp", "w", encoding="utf-8") as f:
        f.write(torch.cuda.memory_summary(device))
    os.replace(text_path + ".tmp", text_path)
    seconds = round(time.perf_counter() - t0, 6)
    return {"path": pickle_path, "summary_path": text_path, "history": history, "reason": reason, "seconds": seconds}


def take(folder: str, device: torch.device, owner: object, *, step: int, reason: str) -> tuple[str, dict[str, Any]]:
    """Dump a snapshot for a request or an OOM: the event that answers it (saved, or refused when it
    cannot be written). From then on allocations are recorded, until `owner`'s run ends: the first
    snapshot shows only the present."""
    try:
        event = "snapshot_saved", dump(folder, device, step=step, reason=reason)
    except (OSError, RuntimeError) as exc:  # a full disk; torch's own error (a CUDA error pending)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        event = "control_refused", {"action": "snapshot", "reason": f"cannot write the snapshot: {first}"}
    start_history(owner)
    return event
