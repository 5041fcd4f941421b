"""The immutable records every consumer reads: one memory reading, one step, one event.

The engine makes them, the metrics file, the progress line, the TUI and the socket read them.
Frozen dataclasses so a reader on another thread never sees one half-written.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from operator import itemgetter
from typing import Any

from .rows import Layout

VERSION = 1
"""Version of the metrics file's records (the attach protocol has its own: protocol.VERSION);
bumped on any incompatible change."""


_NAMES: dict[type, tuple[str, ...]] = {}


def _names(cls: type) -> tuple[str, ...]:
    """A dataclass's field names, in order (dataclasses.fields() costs microseconds a call: records
    are read and written many times a second)."""
    names = _NAMES.get(cls)
    if names is None:
        names = _NAMES[cls] = tuple(f.name for f in fields(cls))
    return names


def _known(cls: type, data: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of `data` that are fields of `cls`: a newer peer may send more."""
    return {k: data[k] for k in _names(cls) if k in data}


def finite(x: float | None) -> float | None:
    """JSON has no NaN or Infinity: such values are written as null."""
    if x is None or math.isfinite(x):
        return x
    return None


@dataclass(frozen=True, slots=True)
class Memory:
    """One reading of the training device's memory, in bytes; None where the device has no such figure.

    `allocated`/`reserved`/`fragmented` follow the CUDA caching allocator; on a CPU device
    `allocated` is the tracked training state (parameters, gradients, optimizer state and
    activations saved for backward) and `capacity` the budget, if one is set.
    """

    device: str
    allocated: int | None = None
    reserved: int | None = None
    fragmented: int | None = None
    peak: int | None = None
    capacity: int | None = None
    rss: int | None = None
    params: int | None = None
    grads: int | None = None
    optimizer: int | None = None
    activations: int | None = None
    alloc_retries: int | None = None
    ooms: int | None = None
    active: int | None = None
    device_free: int | None = None
    nvml_used: int | None = None
    """What NVML says this process holds on the device: includes the CUDA context and memory
    allocated outside PyTorch, which `reserved` cannot see. None where NVML names no such pid (in
    a container it lists the host's pids) or hides its figure."""
    nvml_device_used: int | None = None
    """What every process holds on the device, this one included."""

    @property
    def nvml_gap(self) -> int | None:
        """NVML used minus PyTorch reserved: the CUDA context, cuBLAS/cuDNN/NCCL workspaces and
        any other allocation outside PyTorch's caching allocator."""
        if self.nvml_used is None or self.reserved is None:
            return None
        return self.nvml_used - self.reserved

    @property
    def nvml_others(self) -> int | None:
        """What the device's other processes hold; None where this process's share is unknown."""
        if self.nvml_used is None or self.nvml_device_used is None:
            return None
        return max(0, self.nvml_device_used - self.nvml_used)

    @property
    def cached_free(self) -> int | None:
        """Reserved by the caching allocator but holding no tensor: reusable, not returned to the device."""
        if self.reserved is None or self.allocated is None:
            return None
        return max(0, self.reserved - self.allocated)

    def to_json(self) -> dict[str, Any]:
        return {
            **{name: getattr(self, name) for name in _names(type(self))},
            "cached_free": self.cached_free,
            "nvml_gap": self.nvml_gap,
        }


@dataclass(frozen=True, slots=True)
class GpuProcess:
    """One process NVML sees on a GPU. None: NVML would not say (not supported, or hidden)."""

    pid: int
    gpu_memory: int | None
    kind: str  # "compute" or "graphics"
    user: str | None = None
    command: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _names(type(self))}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> GpuProcess:
        return cls(**_known(cls, data))


@dataclass(frozen=True, slots=True)
class RankMemory:
    """One rank of a torchrun job as the step's exchange told every rank: its micro-batch, and its
    step peak and capacity (bytes; None where unknown) one step late. The worst rank (peak over
    capacity) is the one whose OOM comes first."""

    rank: int
    micro_batch: int
    peak: int | None = None
    capacity: int | None = None
    loss: float | None = None  # its last step's loss (its share's)
    samples_per_s: float | None = None
    ooms: int = 0  # OOMs it recovered from, in all

    def to_json(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _names(type(self))}


@dataclass(frozen=True, slots=True)
class GpuDevice:
    """One GPU as NVML reports it. Every field NVML may refuse is None ("n/a" on screen);
    `error` says why the whole device could not be read, if it could not."""

    index: int
    uuid: str | None = None
    name: str | None = None
    utilization: int | None = None  # percent of time a kernel ran, over the last sample period
    memory_used: int | None = None
    memory_total: int | None = None
    temperature: int | None = None  # degrees C
    power: float | None = None  # watts
    power_limit: float | None = None  # watts
    processes: tuple[GpuProcess, ...] = ()
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        out = {name: getattr(self, name) for name in _names(type(self))}
        out["processes"] = [p.to_json() for p in self.processes]
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> GpuDevice:
        values = _known(cls, data)
        values["processes"] = tuple(GpuProcess.from_json(p) for p in data.get("processes") or ())
        return cls(**values)


@dataclass(frozen=True, slots=True)
class GpuReading:
    """All GPUs at one moment. `status` is None when NVML answered, else one line saying why not
    ("no NVIDIA driver is loaded", "the NVML library was not found", ...)."""

    t: float
    devices: tuple[GpuDevice, ...] = ()
    driver: str | None = None
    status: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "v": VERSION,
            "kind": "gpus",
            "t": round(self.t, 6),
            "driver": self.driver,
            "status": self.status,
            "devices": [d.to_json() for d in self.devices],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> GpuReading:
        return cls(
            t=float(data["t"]),
            driver=data.get("driver"),
            status=data.get("status"),
            devices=tuple(GpuDevice.from_json(d) for d in data.get("devices") or ()),
        )


@dataclass(frozen=True, slots=True)
class HostReading:
    """The host around the training process: its resident memory and CPU use, the system's memory."""

    rss: int | None = None
    cpu_percent: float | None = None  # of one core: 250 means two and a half cores busy
    system_used: int | None = None
    system_total: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _names(type(self))}


@dataclass(frozen=True, slots=True)
class StepSample:
    """What one optimizer step left behind: progress, the settings it ran with, and memory after it.

    The engine publishes its fields by position (a row of hub.rows, then a StepRecord): a new
    field goes last."""

    t: float
    step: int
    epoch: int
    loss: float | None
    batch_size: int
    micro_batch: int
    accumulation: int
    amp: str
    checkpointing: bool
    samples_per_s: float | None
    memory: Memory
    samples: int = 0
    host: HostReading | None = None
    loss_source: str | None = None  # None: fit's step(); else where a script's own loop showed it
    steps_per_s: float | None = None
    ranks: tuple[RankMemory, ...] = ()  # under torchrun, every rank (in rank order); () for one process
    grad_norm: float | None = None
    """The newest total gradient norm read, before clipping (fit's loop; on CUDA usually a step late, as
    the loss); None where none was measured (an own loop), inf or nan for a step the GradScaler skipped."""

    def to_json(self) -> dict[str, Any]:
        m = self.memory
        return {
            "v": VERSION,
            "kind": "step",
            "t": round(self.t, 6),
            "step": self.step,
            "epoch": self.epoch,
            "loss": finite(self.loss),
            "batch_size": self.batch_size,
            "micro_batch": self.micro_batch,
            "accumulation": self.accumulation,
            "amp": self.amp,
            "checkpointing": self.checkpointing,
            "device": m.device,
            "allocated": m.allocated,
            "reserved": m.reserved,
            "fragmented": m.fragmented,
            "peak": m.peak,
            "rss": m.rss,
            "samples_per_s": None if self.samples_per_s is None else round(self.samples_per_s, 3),
            "samples": self.samples,
            "memory": m.to_json(),
            "host": None if self.host is None else self.host.to_json(),
            "loss_source": self.loss_source,
            "steps_per_s": None if self.steps_per_s is None else round(self.steps_per_s, 3),
            **({"ranks": [r.to_json() for r in self.ranks]} if self.ranks else {}),
            "grad_norm": finite(self.grad_norm),
        }


class StepRecord:
    """A step as the hub keeps it: the row the training thread published (StepSample's fields in their
    order, in a list; a tuple for a sample made already).

    Building the frozen StepSample costs microseconds that most steps need not pay: a screen reads a
    few samples a second, the socket's server on its own thread. So the sample is made when a reader
    first asks for it, on the reader's thread, and kept for the readers after it."""

    __slots__ = ("fields", "step", "_sample")

    def __init__(self, fields: Sequence[Any], sample: StepSample | None = None) -> None:
        self.fields = fields
        self.step: int = fields[STEP_AT]
        self._sample = sample

    @classmethod
    def of(cls, sample: StepSample) -> StepRecord:
        """A sample made already (one received from a job, a test's)."""
        return cls(STEP_ROW.values(sample), sample)

    def sample(self) -> StepSample:
        sample = self._sample
        if sample is None:  # two readers at once may both make it: equal samples, one kept
            sample = self._sample = StepSample(*self.fields)
        return sample

    def charted(self) -> tuple[int, float | None, Memory, float | None]:
        """(step, loss, memory, grad_norm): what the run's charts take, read without making the sample (the job's
        server folds every step into the history a welcome sends)."""
        return _charted(self.fields)

    def row(self) -> list[Any]:
        """The step as the attach protocol sends it (a row of a `steps` record, rows.py): a step costs
        the server a few attribute reads, not a dict of ~40 keys, and the client no key lookups."""
        return STEP_ROW.row(self.fields)

    @classmethod
    def from_row(cls, row: list[Any]) -> StepRecord:
        """A row back into a step, its sample made (the row's shape and types checked already:
        STEP_ROW.check())."""
        fields = STEP_ROW.fields(row)
        return cls(fields, StepSample(*fields))


@dataclass(frozen=True, slots=True)
class Event:
    """Something that happened at a step boundary: a remedy applied, an OOM recovered, an error."""

    name: str
    step: int
    details: Mapping[str, Any] = field(default_factory=dict)
    t: float = field(default_factory=time.time)

    def to_json(self) -> dict[str, Any]:
        return {
            "v": VERSION,
            "kind": "event",
            "t": round(self.t, 6),
            "step": self.step,
            "name": self.name,
            **self.details,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Event:
        details = {k: v for k, v in data.items() if k not in ("v", "kind", "t", "step", "name")}
        return cls(name=str(data["name"]), step=int(data["step"]), details=details, t=float(data["t"]))

    def __getitem__(self, key: str) -> Any:
        return self.details[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.details.get(key, default)


STEP_ROW = Layout(
    StepSample, "a steps record's row", {Memory: "memory", HostReading: "host reading", RankMemory: "rank"}
)
"""A step's row on the wire, read from StepSample's declaration (and its records')."""
STEP_AT = STEP_ROW.index("step")
"""Where a step's row (a StepRecord's fields, a row of hub.rows) holds its step number."""
RATE_FROM = (STEP_ROW.index("t"), STEP_AT, STEP_ROW.index("samples"))
"""Where a row holds what its rates are derived from (telemetry/rate.py): its time, step and samples."""
RATES_AT = (STEP_ROW.index("steps_per_s"), STEP_ROW.index("samples_per_s"))
"""Where a row holds its rates, filled in as the hub drains it."""
_charted = itemgetter(STEP_AT, STEP_ROW.index("loss"), STEP_ROW.index("memory"), STEP_ROW.index("grad_norm"))
