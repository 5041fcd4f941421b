"""CUDA memory snapshots: the allocator's history as a pickle that pytorch.org/memory_viz opens,
and `torch.cuda.memory_summary()` as text beside it."""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from ..telemetry.controls import SNAPSHOT_NEEDS_CUDA
from ..telemetry.run import launched_rank

_recording = False

MAX_ENTRIES = 100_000
"""Allocation events kept while recording: enough for many steps of a large model, ~10s of MB."""


def unavailable(device: torch.device) -> str | None:
    return None if device.type == "cuda" else SNAPSHOT_NEEDS_CUDA


def recording() -> bool:
    return _recording


def start_history() -> None:
    """Record every allocation with its stack from now on (costs some CPU per allocation)."""
    global _recording
    if not _recording:
        torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES)
        _recording = True


def dump(folder: str, device: torch.device, *, step: int, reason: str) -> dict[str, Any]:
    """Write the snapshot and the summary under `folder`; returns the paths for the event."""
    os.makedirs(folder, exist_ok=True)
    rank = launched_rank()  # under torchrun every rank writes its own, into one folder
    who = f"{os.getpid()}" if rank is None else f"rank{rank}-{os.getpid()}"
    stem = os.path.join(os.path.abspath(folder), f"snapshot-{who}-step{step}-{reason}-{time.strftime('%Y%m%d-%H%M%S')}")
    pickle_path, text_path = stem + ".pickle", stem + ".txt"
    torch.cuda.memory._dump_snapshot(pickle_path + ".tmp")
    os.replace(pickle_path + ".tmp", pickle_path)
    with open(text_path + ".tmp", "w", encoding="utf-8") as f:
        f.write(torch.cuda.memory_summary(device))
    os.replace(text_path + ".tmp", text_path)
    return {"path": pickle_path, "summary_path": text_path, "history": _recording, "reason": reason}


def take(folder: str, device: torch.device, *, step: int, reason: str) -> tuple[str, dict[str, Any]]:
    """Dump a snapshot for a request or an OOM: the event that answers it (saved, or refused when it
    cannot be written). From then on allocations are recorded: the first snapshot shows only the present."""
    try:
        event = "snapshot_saved", dump(folder, device, step=step, reason=reason)
    except OSError as exc:
        event = "control_refused", {"action": "snapshot", "reason": f"cannot write the snapshot: {exc}"}
    start_history()
    return event
