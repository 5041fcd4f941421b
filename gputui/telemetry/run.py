"""The records a run begins and ends with: what is training (RunInfo) and how it went (RunSummary).

Frozen like the samples, and typed: the engine makes them, the hub carries them, the metrics
file, the progress line, the socket and the TUI read their fields. `refused` tells every reader
which controls this run will not take, and why, so no reader keeps its own list.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from .sample import finite

NUMBER = (int, float)


def _checked(cls: type, data: Mapping[str, Any], types: Mapping[str, Any]) -> dict[str, Any]:
    """The known fields of `data`, each of the type the readers expect; ValueError naming one that is not.
    A newer peer may send more fields (dropped) or fewer (the defaults)."""
    values = {}
    for f in fields(cls):
        if f.name not in data or data[f.name] is None:
            continue
        value, accepted = data[f.name], types[f.name]
        if not isinstance(value, accepted) or (isinstance(value, bool) and accepted is not bool):
            raise ValueError(f"{cls.__name__}.{f.name} is a {type(value).__name__}")
        values[f.name] = value
    return values


def launched_rank() -> int | None:
    """This process's rank when torchrun launched it among several (WORLD_SIZE > 1); None otherwise.
    Read from the environment: torchrun sets it before any process group exists."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    return int(os.environ.get("RANK", "0"))


@dataclass(frozen=True)
class RunInfo:
    """What is training and how, as the run begins. `mode`: "fit" (gputui's loop) or "observe"
    (the script's own loop, watched)."""

    mode: str = "fit"
    pid: int = 0
    started: float = 0.0
    argv: tuple[str, ...] = ()
    device: str = "cpu"
    device_name: str = ""
    model: str = ""
    params: int = 0
    trainable: int = 0
    optimizer: str = ""
    epochs: int | None = None
    max_steps: int | None = None
    steps_per_epoch: int | None = None
    total_steps: int | None = None
    micro_batch: int | None = None
    batch_norm: int = 0
    min_micro_batch: int = 1
    amp: str = "off"
    checkpointing: bool = False
    checkpointing_how: str | None = None
    auto_recover: bool = True
    memory_budget: int | None = None
    clip_grad_norm: float | None = None  # fit's clip_grad_norm: the largest gradient norm a step keeps
    refused: Mapping[str, str] = field(default_factory=dict)
    """Control action -> why this run refuses it (an own loop cannot change its batch, a model
    without repeated blocks has nothing to checkpoint). Absent: the run takes it."""
    unreadable: Mapping[str, str] = field(default_factory=dict)
    """Memory figure -> why this run cannot read it (CUDA's `backend:cudaMallocAsync` counts no
    fragmentation, retries or OOMs; expandable segments no fragmentation): null in every reading,
    "n/a (why)" on the screen, never a 0 that was not counted."""
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    node: int = 0  # torchrun's GROUP_RANK: which node of the job
    hostname: str = ""
    job: str = ""
    """Under torchrun, what the ranks of one job share (its run id and rendezvous): "" for one process."""

    @property
    def observed(self) -> bool:
        return self.mode == "observe"

    def continued(self, details: Mapping[str, Any]) -> RunInfo:
        """The info of a run another fit call or Trainer continues (a `run_continued` event's details)."""
        fields = {k: details[k] for k in CONTINUED if k in details}
        if "refused" in fields:
            fields["refused"] = dict(fields["refused"] or {})
        checked = _checked(RunInfo, {k: v for k, v in fields.items() if v is not None}, _INFO_TYPES)
        return replace(self, **{**{k: None for k, v in fields.items() if v is None}, **checked})

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["argv"], out["refused"], out["unreadable"] = list(self.argv), dict(self.refused), dict(self.unreadable)
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RunInfo:
        values = _checked(cls, data, _INFO_TYPES)
        if "argv" in values:
            if not all(isinstance(arg, str) for arg in values["argv"]):
                raise ValueError("RunInfo.argv holds a non-string")
            values["argv"] = tuple(values["argv"])
        for name in ("refused", "unreadable"):
            if name in values:
                if not all(isinstance(k, str) and isinstance(v, str) for k, v in values[name].items()):
                    raise ValueError(f"RunInfo.{name} holds a non-string")
                values[name] = dict(values[name])
        return cls(**values)


_INFO_TYPES: dict[str, Any] = {
    "mode": str,
    "pid": int,
    "rank": int,
    "world_size": int,
    "local_rank": int,
    "node": int,
    "hostname": str,
    "job": str,
    "started": NUMBER,
    "argv": (list, tuple),
    "device": str,
    "device_name": str,
    "model": str,
    "params": int,
    "trainable": int,
    "optimizer": str,
    "epochs": int,
    "max_steps": int,
    "steps_per_epoch": int,
    "total_steps": int,
    "micro_batch": int,
    "batch_norm": int,
    "min_micro_batch": int,
    "amp": str,
    "checkpointing": bool,
    "checkpointing_how": str,
    "auto_recover": bool,
    "memory_budget": int,
    "clip_grad_norm": NUMBER,
    "refused": dict,
    "unreadable": dict,
}


CONTINUED = (
    *("model", "epochs", "max_steps", "steps_per_epoch", "total_steps"),
    *("micro_batch", "amp", "checkpointing", "auto_recover", "refused"),
)
"""The info a run continued in the same process may change (engine/continuity.py)."""


@dataclass(frozen=True)
class RunSummary:
    """How the run ended. `stopped`: why it stopped early (a request, a signal); `error`: why it failed."""

    steps: int = 0
    epochs: int = 0
    samples: int = 0
    micro_batch: int | None = None
    loss: float | None = None
    stopped: str | None = None
    amp: str = "off"
    checkpointing: bool = False
    ooms_recovered: int = 0
    elapsed_s: float = 0.0
    error: str | None = None

    @property
    def outcome(self) -> str:
        """One word for how it ended: interrupted (a KeyboardInterrupt out of a step: a second Ctrl-C, a
        notebook's interrupt), failed, stopped or finished."""
        if self.error:
            return "interrupted" if self.error.startswith("KeyboardInterrupt") else "failed"
        return "stopped" if self.stopped else "finished"

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "loss": finite(self.loss)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RunSummary:
        return cls(**_checked(cls, data, _SUMMARY_TYPES))


_SUMMARY_TYPES: dict[str, Any] = {
    "steps": int,
    "epochs": int,
    "samples": int,
    "micro_batch": int,
    "loss": NUMBER,
    "stopped": str,
    "amp": str,
    "checkpointing": bool,
    "ooms_recovered": int,
    "elapsed_s": NUMBER,
    "error": str,
}
