"""Control requests: what the TUI, the socket and the API ask the training loop to change.

They live here, not in the engine, because the TUI and the socket server must build them
without importing torch. The engine drains the queue at a step boundary, never inside an
accumulation window, and answers every request with an event.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

AMP_MODES = ("off", "bf16", "fp16")

# action -> allowed values (None: the action takes no value)
ACTIONS: dict[str, tuple[Any, ...] | None] = {
    "halve_batch": None,
    "double_batch": None,
    "set_amp": AMP_MODES,
    "set_checkpointing": (True, False),
    "set_auto_recover": (True, False),
    "free_cache": None,
    "snapshot": None,
    "top_tensors": None,
    "memory_summary": None,
    "plan": None,
    "pause": None,
    "resume": None,
    "stop": None,
}

# Remedies: the actions that change how the next step uses memory. While the loop waits after
# an OOM (auto-recover off), applying one of these retries the batch at once.
REMEDIES = frozenset({"halve_batch", "double_batch", "set_amp", "set_checkpointing", "free_cache"})

CHANGES = frozenset({"halve_batch", "double_batch", "set_amp", "set_checkpointing", "set_auto_recover", "pause"})
"""The controls refused once the run is stopping (the screen dims their keys): no step would train with
them, and the summary would report a setting no step used."""

BATCH_NORM_FLOOR = "BatchNorm needs at least 2 samples per micro-batch"
"""Why a model with BatchNorm is never halved below 2: the engine refuses with it, the TUI dims with it."""

SNAPSHOT_NEEDS_CUDA = (
    "memory snapshots are a CUDA allocator feature; on this device use the top-tensors view, "
    "which shows what holds memory"
)
SUMMARY_NEEDS_CUDA = "memory_summary() is a CUDA allocator report"
"""Why a run off CUDA refuses `snapshot` and `memory_summary`: the engine refuses with them (and
lists them in RunInfo.refused); here, without torch, so test fakes of a CPU run say the same."""

_ids = itertools.count(1)


@dataclass(frozen=True, slots=True)
class Control:
    """One request. `requested_at` (wall clock) lets the event that answers it report the latency."""

    action: str
    value: Any = None
    source: str = "api"
    id: int = field(default_factory=lambda: next(_ids))
    requested_at: float = field(default_factory=time.time)

    def answer(self) -> dict[str, Any]:
        """What every event answering this request carries: which request, from where, how long it waited."""
        return {
            "request_id": self.id,
            "source": self.source,
            "latency_s": round(max(0.0, time.time() - self.requested_at), 6),
        }

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ValueError(f"unknown action {self.action!r} (known: {', '.join(ACTIONS)})")
        allowed = ACTIONS[self.action]
        if allowed is None:
            if self.value is not None:
                raise ValueError(f"{self.action} takes no value, got {self.value!r}")
        elif self.value not in allowed or isinstance(self.value, bool) != isinstance(allowed[0], bool):
            choices = ", ".join(str(a).lower() for a in allowed)
            raise ValueError(f"{self.action} takes one of {choices}, got {self.value!r}")


class Controls:
    """Thread-safe queue of Control requests; any thread may request, the training thread drains."""

    def __init__(self) -> None:
        self.queued: deque[Control] = deque()
        """Requests not taken yet: its truth is whether one waits (a C-level test, at every step boundary)."""
        self._ready = threading.Condition()

    def request(self, action: str, value: Any = None, *, source: str = "api") -> Control:
        """Queue a request (validated here, so a bad one fails in the caller) and return it."""
        control = Control(action, value, source)
        with self._ready:
            self.queued.append(control)
            self._ready.notify_all()
        return control

    def drain(self) -> list[Control]:
        """Everything requested so far, oldest first. Cheap when nothing is queued: the per-step path."""
        if not self.queued:
            return []
        with self._ready:
            items = list(self.queued)
            self.queued.clear()
        return items

    def has(self, action: str) -> bool:
        """Whether a request for `action` is queued (not taken)."""
        if not self.queued:
            return False
        with self._ready:
            return any(control.action == action for control in self.queued)

    def wait(self, timeout: float) -> bool:
        """Block until a request is queued or the timeout passes; True if one is waiting."""
        with self._ready:
            if not self.queued:
                self._ready.wait(timeout)
            return bool(self.queued)

    def __len__(self) -> int:
        return len(self.queued)
