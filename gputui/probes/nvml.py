"""NVIDIA GPUs as NVML sees them: every device and every process on it, without torch.

NVML answers what the CUDA caching allocator cannot: the device's whole "used" (the CUDA
context, other processes), utilization, temperature and power. `pynvml` (from the package
nvidia-ml-py) is imported on first use, so a machine without it gets a status line instead of
an ImportError. Every call is wrapped: a GPU that refuses one figure shows "n/a" there, a GPU
that fails entirely carries an `error`, and no failure reaches the caller as an exception.

Every function takes `nvml`, a module with pynvml's names, so tests can stub each call.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import psutil

from ..telemetry.hub import Hub
from ..telemetry.sample import GpuDevice, GpuProcess, GpuReading

MIN_INTERVAL = 0.25
"""Seconds between two readings at the fastest: a reading makes about ten calls per GPU."""

COMMAND_WIDTH = 80
"""Characters of a process's command line kept for display."""

_NOT_AVAILABLE = (1 << 64) - 1
"""NVML_VALUE_NOT_AVAILABLE as an unsigned long long: what usedGpuMemory holds when hidden."""

_init_lock = threading.Lock()
_initialized: weakref.WeakSet = weakref.WeakSet()
"""The NVML modules nvmlInit succeeded on: once per process, not once per reading."""

_INIT_FAILURES = (
    (
        "NVMLError_LibraryNotFound",
        "no NVIDIA driver found: libnvidia-ml.so.1 is missing (nvidia-smi would fail too; a container needs --gpus)",
    ),
    ("NVMLError_DriverNotLoaded", "no NVIDIA driver is loaded (nvidia-smi would fail too)"),
    ("NVMLError_NoPermission", "no permission to query the NVIDIA driver (check access to /dev/nvidia*)"),
    (
        "NVMLError_LibRmVersionMismatch",
        "the NVIDIA driver and its NVML library do not match (reboot after a driver update)",
    ),
)


def _module(nvml: Any) -> tuple[Any, str | None]:
    """The NVML bindings, initialized; or None and one line saying why they cannot be used.

    A failed nvmlInit is not remembered: a driver loaded later is picked up by the next call.
    """
    if nvml is None:
        try:
            import pynvml
        except ImportError:
            return None, "the NVML Python bindings are missing (pip install nvidia-ml-py)"
        nvml = pynvml
    with _init_lock:
        if nvml in _initialized:
            return nvml, None
        try:
            nvml.nvmlInit()
        except Exception as exc:  # an old or broken binding can fail with anything
            return None, _init_failure(nvml, exc)
        _initialized.add(nvml)
    return nvml, None


def _init_failure(nvml: Any, exc: Exception) -> str:
    for name, reason in _INIT_FAILURES:
        if isinstance(exc, getattr(nvml, name, ())):
            return reason
    return f"NVML failed to start: {_describe(exc)} (does nvidia-smi work?)"


def _describe(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


def _text(value: Any) -> str:
    """Old bindings return bytes where new ones return str."""
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _field(nvml: Any, call: Callable[..., Any], *args: Any) -> Any:
    """One NVML figure, or None when NVML refuses it (not supported, no permission, ...).

    A lost GPU is not one refused figure: it propagates so the whole device reports it.
    """
    try:
        return call(*args)
    except nvml.NVMLError as exc:
        if isinstance(exc, getattr(nvml, "NVMLError_GpuIsLost", ())):
            raise
        return None


def read_gpus(nvml: Any = None) -> GpuReading:
    """One reading of every GPU. Never raises: what cannot be read is None, an `error` or the `status`."""
    now = time.time()
    nvml, status = _module(nvml)
    if status is not None:
        return GpuReading(t=now, status=status)
    try:
        count = nvml.nvmlDeviceGetCount()
        driver = _field(nvml, nvml.nvmlSystemGetDriverVersion)
    except Exception as exc:
        return GpuReading(t=now, status=f"NVML could not list the GPUs: {_describe(exc)}")
    users: dict[int, tuple[str | None, str | None]] = {}
    devices = tuple(_read_device(nvml, index, users) for index in range(count))
    return GpuReading(t=now, devices=devices, driver=None if driver is None else _text(driver))


def _read_device(nvml: Any, index: int, users: dict[int, tuple[str | None, str | None]]) -> GpuDevice:
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        name = _field(nvml, nvml.nvmlDeviceGetName, handle)
        uuid = _field(nvml, nvml.nvmlDeviceGetUUID, handle)
        utilization = _field(nvml, nvml.nvmlDeviceGetUtilizationRates, handle)
        memory = _field(nvml, nvml.nvmlDeviceGetMemoryInfo, handle)
        power = _field(nvml, nvml.nvmlDeviceGetPowerUsage, handle)
        limit = _field(nvml, nvml.nvmlDeviceGetEnforcedPowerLimit, handle)
        return GpuDevice(
            index=index,
            name=None if name is None else _text(name),
            uuid=None if uuid is None else _text(uuid),
            utilization=None if utilization is None else int(utilization.gpu),
            memory_used=None if memory is None else int(memory.used),
            memory_total=None if memory is None else int(memory.total),
            temperature=_field(nvml, nvml.nvmlDeviceGetTemperature, handle, nvml.NVML_TEMPERATURE_GPU),
            power=None if power is None else power / 1000,
            power_limit=None if limit is None else limit / 1000,
            processes=_read_processes(nvml, handle, users),
        )
    except Exception as exc:  # the device is gone or broken: the other GPUs are still read
        return GpuDevice(index=index, error=f"NVML could not read this GPU: {_describe(exc)}")


def _read_processes(nvml: Any, handle: Any, users: dict[int, tuple[str | None, str | None]]) -> tuple[GpuProcess, ...]:
    """Compute, then graphics processes; a process in both lists is listed once, as compute."""
    found: dict[int, GpuProcess] = {}
    for kind in ("compute", "graphics"):
        for info in _running(nvml, kind, handle):
            pid = int(info.pid)
            if pid in found:
                continue
            if pid not in users:
                users[pid] = _host_process(pid)
            memory = info.usedGpuMemory
            found[pid] = GpuProcess(
                pid=pid,
                kind=kind,
                user=users[pid][0],
                command=users[pid][1],
                gpu_memory=None if memory is None or memory >= _NOT_AVAILABLE else int(memory),
            )
    return tuple(found.values())


def _running(nvml: Any, kind: str, handle: Any) -> list[Any]:
    """NVML's process list; drivers before 510 lack the _v3 call behind the plain name, so _v2 there."""
    call = f"nvmlDeviceGet{kind.title()}RunningProcesses"
    try:
        return _field(nvml, getattr(nvml, call), handle) or []
    except getattr(nvml, "NVMLLibraryMismatchError", ()):
        return _field(nvml, getattr(nvml, call + "_v2"), handle) or []


def _host_process(pid: int) -> tuple[str | None, str | None]:
    """(user, short command line) of a PID, or Nones when it is gone or hidden from us.

    In a container NVML reports host PIDs, which this PID namespace does not have (or has as
    another process: there the user and command may belong to the wrong one).
    """
    try:
        process = psutil.Process(pid)
        with process.oneshot():
            return process.username(), _short(process.cmdline()) or process.name()
    except (psutil.Error, OSError):
        return None, None


def _short(argv: list[str]) -> str:
    if not argv:
        return ""
    line = " ".join([os.path.basename(argv[0]), *argv[1:]])
    return line if len(line) <= COMMAND_WIDTH else line[: COMMAND_WIDTH - 3] + "..."


def process_gpu_memory(reading: GpuReading | None, pid: int, nvml_index: int | None) -> int | None:
    """Bytes NVML says `pid` holds on GPU `nvml_index` in `reading`; None if NVML did not say."""
    if reading is None or nvml_index is None:
        return None
    for device in reading.devices:
        if device.index == nvml_index:
            return next((p.gpu_memory for p in device.processes if p.pid == pid), None)
    return None


def cuda_to_nvml_index(cuda_index: int, nvml: Any = None, *, cuda_uuid: str | None = None) -> int | None:
    """The NVML index of the GPU that CUDA (and torch) calls `cuda_index`, or None when unsure.

    NVML numbers GPUs in PCI bus order; CUDA numbers only the devices CUDA_VISIBLE_DEVICES
    shows, in CUDA_DEVICE_ORDER, whose default FASTEST_FIRST may put a faster model first.
    In order of trust:

    1. `cuda_uuid` (from `torch.cuda.get_device_properties(i).uuid`, with or without the
       "GPU-"/"MIG-" prefix) is matched against NVML's UUIDs; a MIG instance maps to its
       parent GPU. A UUID NVML does not know gives None: NVML then sees other GPUs than CUDA,
       and no index guess can be trusted.
    2. CUDA_VISIBLE_DEVICES is read as CUDA reads it, up to its first invalid entry: UUIDs
       ("GPU-8f2c..." or a unique prefix), "MIG-..." (the parent GPU) or ordinals.
    3. Ordinals, and CUDA's own numbering when the variable is unset, are NVML indices when
       CUDA_DEVICE_ORDER=PCI_BUS_ID or every GPU is the same model (FASTEST_FIRST then keeps
       PCI order). Different models under FASTEST_FIRST: None, since the order CUDA picks
       cannot be known from NVML; pass `cuda_uuid` there.

    None also when NVML is unavailable or the index is not visible. Never raises.
    """
    nvml, status = _module(nvml)
    if status is not None or cuda_index < 0:
        return None
    try:
        handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
        uuids = [_text(nvml.nvmlDeviceGetUUID(h)) for h in handles]
        if cuda_uuid is not None:
            return _by_uuid(nvml, cuda_uuid, uuids)
        ordinals = (
            os.environ.get("CUDA_DEVICE_ORDER", "").strip().upper() == "PCI_BUS_ID"
            or len({_field(nvml, nvml.nvmlDeviceGetName, h) for h in handles}) <= 1
        )
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        entries = [str(i) for i in range(len(uuids))] if visible is None else visible.split(",")
        if cuda_index >= len(entries):
            return None
        for entry in entries[:cuda_index]:  # an invalid entry hides every entry after it
            _visible_entry(nvml, entry, uuids, ordinals)
        return _visible_entry(nvml, entries[cuda_index], uuids, ordinals)
    except Exception:  # an invalid entry, a GPU that fails: the mapping is unknown, not broken
        return None


def _by_uuid(nvml: Any, cuda_uuid: str, uuids: list[str]) -> int | None:
    bare = cuda_uuid.strip().lower().removeprefix("gpu-").removeprefix("mig-")
    for index, uuid in enumerate(uuids):
        if uuid.lower().removeprefix("gpu-") == bare:
            return index
    return _mig_parent(nvml, "MIG-" + bare)


def _visible_entry(nvml: Any, entry: str, uuids: list[str], ordinals: bool) -> int | None:
    """NVML index of one CUDA_VISIBLE_DEVICES entry, None when it cannot be placed.

    Raises ValueError for an entry CUDA rejects (which hides it and every entry after it).
    """
    entry = entry.strip()
    if entry.isdigit():
        if int(entry) >= len(uuids):
            raise ValueError(entry)
        return int(entry) if ordinals else None
    if entry.upper().startswith("MIG-GPU-"):  # pre-R470 form: MIG-GPU-<parent uuid>/<gi>/<ci>
        entry = entry[4:].split("/")[0]
    elif entry.upper().startswith("MIG-"):
        return _mig_parent(nvml, entry)
    matches = [i for i, uuid in enumerate(uuids) if uuid.lower().startswith(entry.lower())]
    if not entry.upper().startswith("GPU-") or len(matches) != 1:
        raise ValueError(entry)
    return matches[0]


def _mig_parent(nvml: Any, mig_uuid: str) -> int | None:
    try:
        mig = nvml.nvmlDeviceGetHandleByUUID(mig_uuid)
        return int(nvml.nvmlDeviceGetIndex(nvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(mig)))
    except Exception:  # not a MIG device NVML knows, or bindings without MIG calls
        return None


class NvmlPoller:
    """Reads every GPU on a daemon thread, at most once per `interval` seconds.

    Readers call `latest()` without a lock (the reading is immutable and replaced by one attribute
    assignment), or are handed each reading (`on_reading`: `feed()` publishes them into a hub, where
    training reads them). When NVML is unavailable the first reading says why and the
    thread ends: retrying every second would only repeat it.
    """

    def __init__(
        self, interval: float = 1.0, *, nvml: Any = None, on_reading: Callable[[GpuReading], None] | None = None
    ) -> None:
        self.interval = max(MIN_INTERVAL, float(interval))
        self._nvml = nvml
        self._on_reading = on_reading
        self._latest: GpuReading | None = None
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def latest(self) -> GpuReading | None:
        """The newest reading, or None before the first."""
        return self._latest

    @property
    def running(self) -> bool:
        """Whether the thread still polls (False before start, after stop, or when NVML is unavailable)."""
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> NvmlPoller:
        if self._thread is None:
            self._thread = threading.Thread(target=self._poll, name="gputui-nvml", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)  # a hung NVML call must not hold the process's exit

    def __enter__(self) -> NvmlPoller:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _poll(self) -> None:
        while not self._stopping.is_set():
            started = time.monotonic()
            try:
                self._latest = read_gpus(self._nvml)
            except Exception as exc:  # read_gpus does not raise; if it ever does, say so and stop
                self._latest = GpuReading(t=time.time(), status=f"reading the GPUs failed: {_describe(exc)}")
            if self._on_reading is not None:
                self._on_reading(self._latest)
            if self._latest.status is not None:
                return
            self._stopping.wait(self.interval - (time.monotonic() - started))


def feed(hub: Hub) -> None:
    """Poll every GPU into `hub` from now until its telemetry closes (once per hub): the readings
    travel through the hub, where the panels, the socket and the training probe read them."""
    if hub.feeds_gpus:
        return
    hub.feeds_gpus = True
    hub.on_close(NvmlPoller(on_reading=hub.publish_gpus).start().stop)
