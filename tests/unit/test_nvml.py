"""The NVML probe against a stub of pynvml: every call the probe makes is one the stub answers or fails."""

from __future__ import annotations

import ctypes
import inspect
import io
import json
import os
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace

import psutil
import pynvml
import pytest

from gputui import watch
from gputui.probes import nvml as probe
from gputui.telemetry.sample import GpuReading

GiB = 1024**3
UUID_A = "GPU-aaaaaaaa-1111-2222-3333-444444444444"
UUID_B = "GPU-bbbbbbbb-5555-6666-7777-888888888888"


# The error hierarchy of nvidia-ml-py: one subclass of NVMLError per NVML_ERROR_* code.
class NVMLError(Exception):
    value = 999
    text = "Unknown Error"

    def __str__(self) -> str:
        return self.text


def _error(name: str, value: int, text: str) -> type[NVMLError]:
    return type(name, (NVMLError,), {"value": value, "text": text})


NVMLError_InvalidArgument = _error("NVMLError_InvalidArgument", 2, "Invalid Argument")
NVMLError_NotSupported = _error("NVMLError_NotSupported", 3, "Not Supported")
NVMLError_NoPermission = _error("NVMLError_NoPermission", 4, "Insufficient Permissions")
NVMLError_NotFound = _error("NVMLError_NotFound", 6, "Not Found")
NVMLError_DriverNotLoaded = _error("NVMLError_DriverNotLoaded", 9, "Driver Not Loaded")
NVMLError_LibraryNotFound = _error("NVMLError_LibraryNotFound", 12, "NVML Shared Library Not Found")
NVMLError_GpuIsLost = _error("NVMLError_GpuIsLost", 15, "GPU is lost")
NVMLError_Unknown = _error("NVMLError_Unknown", 999, "Unknown Error")


class NVMLLibraryMismatchError(Exception):
    """Not an NVMLError: what the unversioned process calls raise on drivers without _v3."""


@dataclass
class Gpu:
    name: str | bytes = "NVIDIA H100 80GB HBM3"
    uuid: str = UUID_A
    utilization: int = 87
    used: int = 40 * GiB
    total: int = 80 * GiB
    temperature: int = 45
    power_mw: int = 312_000
    limit_mw: int = 700_000
    compute: list[tuple[int, int | None]] = field(default_factory=list)  # (pid, usedGpuMemory)
    graphics: list[tuple[int, int | None]] = field(default_factory=list)
    fails: dict[str, BaseException] = field(default_factory=dict)  # NVML function name -> what it raises
    migs: tuple[str, ...] = ()


@dataclass(frozen=True)
class Handle:
    index: int
    mig: str | None = None


class FakeNvml:
    """pynvml's names and signatures, answering from `gpus`; `calls` counts every call."""

    NVMLError = NVMLError
    NVMLError_InvalidArgument = NVMLError_InvalidArgument
    NVMLError_NotSupported = NVMLError_NotSupported
    NVMLError_NoPermission = NVMLError_NoPermission
    NVMLError_NotFound = NVMLError_NotFound
    NVMLError_DriverNotLoaded = NVMLError_DriverNotLoaded
    NVMLError_LibraryNotFound = NVMLError_LibraryNotFound
    NVMLError_GpuIsLost = NVMLError_GpuIsLost
    NVMLError_Unknown = NVMLError_Unknown
    NVMLLibraryMismatchError = NVMLLibraryMismatchError
    NVML_TEMPERATURE_GPU = 0
    NVML_VALUE_NOT_AVAILABLE_ulonglong = ctypes.c_ulonglong(-1)

    def __init__(
        self,
        *gpus: Gpu,
        init_error: BaseException | None = None,
        driver: str = "550.54.15",
        fails: dict[str, BaseException] | None = None,
    ) -> None:
        self.gpus = list(gpus)
        self.init_error = init_error
        self.driver = driver
        self.fails = fails or {}  # system-wide NVML function name -> what it raises
        self.calls: Counter[str] = Counter()
        self.count_times: list[float] = []

    def _gpu(self, function: str, handle: Handle) -> Gpu:
        self.calls[function] += 1
        gpu = self.gpus[handle.index]
        if function in gpu.fails:
            raise gpu.fails[function]
        return gpu

    def nvmlInit(self):
        self.calls["nvmlInit"] += 1
        if self.init_error is not None:
            raise self.init_error

    def nvmlSystemGetDriverVersion(self):
        if "nvmlSystemGetDriverVersion" in self.fails:
            raise self.fails["nvmlSystemGetDriverVersion"]
        return self.driver

    def nvmlDeviceGetCount(self):
        self.count_times.append(time.monotonic())
        if "nvmlDeviceGetCount" in self.fails:
            raise self.fails["nvmlDeviceGetCount"]
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index):
        self._gpu("nvmlDeviceGetHandleByIndex", Handle(index))
        return Handle(index)

    def nvmlDeviceGetName(self, handle):
        return self._gpu("nvmlDeviceGetName", handle).name

    def nvmlDeviceGetUUID(self, handle):
        return self._gpu("nvmlDeviceGetUUID", handle).uuid

    def nvmlDeviceGetUtilizationRates(self, handle):
        return SimpleNamespace(gpu=self._gpu("nvmlDeviceGetUtilizationRates", handle).utilization, memory=30)

    def nvmlDeviceGetMemoryInfo(self, handle, version=None):
        gpu = self._gpu("nvmlDeviceGetMemoryInfo", handle)
        return SimpleNamespace(total=gpu.total, free=gpu.total - gpu.used, used=gpu.used)

    def nvmlDeviceGetTemperature(self, handle, sensor):
        gpu = self._gpu("nvmlDeviceGetTemperature", handle)
        if sensor != self.NVML_TEMPERATURE_GPU:
            raise NVMLError_InvalidArgument()
        return gpu.temperature

    def nvmlDeviceGetPowerUsage(self, handle):
        return self._gpu("nvmlDeviceGetPowerUsage", handle).power_mw

    def nvmlDeviceGetEnforcedPowerLimit(self, handle):
        return self._gpu("nvmlDeviceGetEnforcedPowerLimit", handle).limit_mw

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        return _processes(self._gpu("nvmlDeviceGetComputeRunningProcesses", handle).compute)

    def nvmlDeviceGetComputeRunningProcesses_v2(self, handle):
        return _processes(self._gpu("nvmlDeviceGetComputeRunningProcesses_v2", handle).compute)

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle):
        return _processes(self._gpu("nvmlDeviceGetGraphicsRunningProcesses", handle).graphics)

    def nvmlDeviceGetGraphicsRunningProcesses_v2(self, handle):
        return _processes(self._gpu("nvmlDeviceGetGraphicsRunningProcesses_v2", handle).graphics)

    def nvmlDeviceGetHandleByUUID(self, uuid):
        for index, gpu in enumerate(self.gpus):
            if uuid in gpu.migs:
                return Handle(index, mig=uuid)
            if uuid == gpu.uuid:
                return Handle(index)
        raise NVMLError_NotFound()

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, migDevice):
        if migDevice.mig is None:
            raise NVMLError_InvalidArgument()
        return Handle(migDevice.index)

    def nvmlDeviceGetIndex(self, handle):
        return handle.index


def _processes(entries):
    return [
        SimpleNamespace(pid=pid, usedGpuMemory=memory, gpuInstanceId=0xFFFFFFFF, computeInstanceId=0xFFFFFFFF)
        for pid, memory in entries
    ]


def two_gpus(**second) -> FakeNvml:
    return FakeNvml(Gpu(), Gpu(**{"uuid": UUID_B, **second}))


@pytest.fixture
def hidden_pids(monkeypatch):
    """PIDs psutil cannot see: {pid: exception}; every other PID is looked up for real."""
    hidden: dict[int, Exception] = {}
    real = psutil.Process

    def process(pid=None):
        if pid in hidden:
            raise hidden[pid]
        return real(pid)

    monkeypatch.setattr(psutil, "Process", process)
    return hidden


def test_the_stub_calls_are_real_pynvml_calls():
    """Every function and error the stub offers exists in nvidia-ml-py with the same parameters."""
    for name, member in vars(FakeNvml).items():
        if name.startswith("nvml"):
            real = inspect.signature(getattr(pynvml, name)).parameters
            assert list(inspect.signature(member).parameters)[1:] == list(real), name
        elif name.startswith(("NVMLError", "NVML_")):
            assert hasattr(pynvml, name), name
    assert issubclass(pynvml.NVMLError_GpuIsLost, pynvml.NVMLError)
    assert FakeNvml.NVML_TEMPERATURE_GPU == pynvml.NVML_TEMPERATURE_GPU
    assert FakeNvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value == pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value
    assert not issubclass(pynvml.NVMLLibraryMismatchError, pynvml.NVMLError)


def test_two_healthy_gpus_with_their_processes(hidden_pids):
    me = os.getpid()
    gone = 4_000_001
    hidden_pids[gone] = psutil.NoSuchProcess(gone)
    nvml = two_gpus(
        name=b"NVIDIA A100-SXM4-40GB",
        utilization=3,
        used=1 * GiB,
        total=40 * GiB,
        temperature=31,
        power_mw=61_500,
        limit_mw=400_000,
        compute=[(me, 512 * 1024**2)],
        graphics=[(me, 1), (gone, 7)],
    )
    nvml.gpus[0].compute = [(me, 38 * GiB)]

    reading = probe.read_gpus(nvml)

    assert reading.status is None and reading.driver == "550.54.15"
    first, second = reading.devices
    assert (first.index, first.name, first.uuid) == (0, "NVIDIA H100 80GB HBM3", UUID_A)
    assert (first.utilization, first.memory_used, first.memory_total) == (87, 40 * GiB, 80 * GiB)
    assert (first.temperature, first.power, first.power_limit, first.error) == (45, 312.0, 700.0, None)
    assert (second.name, second.utilization, second.temperature, second.power, second.power_limit) == (
        "NVIDIA A100-SXM4-40GB",
        3,
        31,
        61.5,
        400.0,
    )
    me_user = psutil.Process(me).username()
    (mine,) = first.processes
    assert (mine.pid, mine.gpu_memory, mine.kind, mine.user) == (me, 38 * GiB, "compute", me_user)
    assert mine.command.split()[0] == os.path.basename(psutil.Process(me).cmdline()[0])
    assert len(mine.command) <= probe.COMMAND_WIDTH
    # compute and graphics: listed once, as compute; a PID gone from the host keeps its pid only
    assert [(p.pid, p.kind, p.gpu_memory) for p in second.processes] == [
        (me, "compute", 512 * 1024**2),
        (gone, "graphics", 7),
    ]
    assert (second.processes[1].user, second.processes[1].command) == (None, None)
    assert nvml.calls["nvmlInit"] == 1


def test_a_pid_psutil_may_not_see_keeps_its_pid(hidden_pids):
    hidden_pids[4_000_002] = psutil.AccessDenied(4_000_002)
    nvml = FakeNvml(Gpu(compute=[(4_000_002, 3 * GiB)]))

    (process,) = probe.read_gpus(nvml).devices[0].processes

    assert (process.pid, process.gpu_memory, process.user, process.command) == (4_000_002, 3 * GiB, None, None)


def test_refused_figures_are_none_and_the_rest_is_read():
    nvml = two_gpus(
        fails={
            "nvmlDeviceGetPowerUsage": NVMLError_NotSupported(),
            "nvmlDeviceGetEnforcedPowerLimit": NVMLError_NoPermission(),
            "nvmlDeviceGetTemperature": NVMLError_NotSupported(),
            "nvmlDeviceGetUtilizationRates": NVMLError_NotSupported(),
            "nvmlDeviceGetComputeRunningProcesses": NVMLError_NotSupported(),
        },
        graphics=[(os.getpid(), GiB)],
    )

    first, second = probe.read_gpus(nvml).devices

    assert (second.power, second.power_limit, second.temperature, second.utilization) == (None, None, None, None)
    assert (second.name, second.memory_used, second.memory_total, second.error) == (
        "NVIDIA H100 80GB HBM3",
        40 * GiB,
        80 * GiB,
        None,
    )
    assert [(p.kind, p.gpu_memory) for p in second.processes] == [("graphics", GiB)]
    assert (first.power, first.temperature, first.utilization) == (312.0, 45, 87)


@pytest.mark.parametrize("hidden", [None, (1 << 64) - 1])
def test_hidden_process_memory_is_none(hidden):
    nvml = FakeNvml(Gpu(compute=[(os.getpid(), hidden)]))

    (process,) = probe.read_gpus(nvml).devices[0].processes

    assert process.pid == os.getpid() and process.gpu_memory is None


def test_drivers_without_v3_process_calls_fall_back_to_v2():
    mismatch = NVMLLibraryMismatchError("Unversioned function called ...")
    nvml = FakeNvml(
        Gpu(
            compute=[(os.getpid(), GiB)],
            fails={"nvmlDeviceGetComputeRunningProcesses": mismatch, "nvmlDeviceGetGraphicsRunningProcesses": mismatch},
        )
    )

    device = probe.read_gpus(nvml).devices[0]

    assert device.error is None and [(p.pid, p.gpu_memory) for p in device.processes] == [(os.getpid(), GiB)]
    assert nvml.calls["nvmlDeviceGetComputeRunningProcesses_v2"] == 1


@pytest.mark.parametrize(
    "function, error",
    [
        ("nvmlDeviceGetHandleByIndex", NVMLError_Unknown()),
        ("nvmlDeviceGetMemoryInfo", NVMLError_GpuIsLost()),
        ("nvmlDeviceGetName", RuntimeError("binding bug")),
    ],
)
def test_one_failing_gpu_has_an_error_and_the_other_is_complete(function, error):
    nvml = FakeNvml(Gpu(fails={function: error}), Gpu(uuid="GPU-bbbb", compute=[(os.getpid(), GiB)]))

    reading = probe.read_gpus(nvml)

    broken, healthy = reading.devices
    assert reading.status is None
    assert broken.index == 0 and broken.error == f"NVML could not read this GPU: {error}"
    assert "\n" not in broken.error and broken.memory_used is None
    assert healthy.error is None and healthy.uuid == "GPU-bbbb" and healthy.memory_used == 40 * GiB
    assert healthy.power == 312.0 and [p.gpu_memory for p in healthy.processes] == [GiB]


def test_a_driver_version_nvml_refuses_is_none():
    nvml = FakeNvml(Gpu(), fails={"nvmlSystemGetDriverVersion": NVMLError_NotSupported()})

    reading = probe.read_gpus(nvml)

    assert reading.driver is None and reading.status is None and len(reading.devices) == 1


@pytest.mark.parametrize(
    "error, expected",
    [
        (
            NVMLError_LibraryNotFound(),
            "no NVIDIA driver found: libnvidia-ml.so.1 is missing (nvidia-smi would fail too; "
            "a container needs --gpus)",
        ),
        (NVMLError_DriverNotLoaded(), "no NVIDIA driver is loaded (nvidia-smi would fail too)"),
        (NVMLError_Unknown(), "NVML failed to start: Unknown Error (does nvidia-smi work?)"),
    ],
)
def test_nvml_that_cannot_start_gives_a_status_line(error, expected):
    nvml = FakeNvml(Gpu(), init_error=error)

    reading = probe.read_gpus(nvml)

    assert reading.status == expected and reading.devices == () and reading.driver is None
    assert probe.read_gpus(nvml).status == expected
    assert nvml.calls["nvmlInit"] == 2  # a failure is retried: the driver may load later


def test_no_bindings_give_a_status_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` raises ImportError

    reading = probe.read_gpus()

    assert reading.status == "the NVML Python bindings are missing (pip install nvidia-ml-py)"
    assert reading.devices == ()
    assert probe.cuda_to_nvml_index(0) is None


def test_nvml_is_initialized_once_across_threads():
    nvml = FakeNvml(Gpu())
    threads = [threading.Thread(target=probe.read_gpus, args=(nvml,)) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert nvml.calls["nvmlInit"] == 1 and len(nvml.count_times) == 8


def test_a_count_nvml_refuses_gives_a_status_line():
    nvml = FakeNvml(Gpu(), fails={"nvmlDeviceGetCount": NVMLError_Unknown()})

    reading = probe.read_gpus(nvml)

    assert reading.status == "NVML could not list the GPUs: Unknown Error" and reading.devices == ()


def test_a_reading_round_trips_through_json(hidden_pids):
    hidden_pids[4_000_003] = psutil.NoSuchProcess(4_000_003)
    nvml = two_gpus(fails={"nvmlDeviceGetPowerUsage": NVMLError_NotSupported()}, compute=[(4_000_003, None)])
    nvml.gpus[0].fails["nvmlDeviceGetHandleByIndex"] = NVMLError_GpuIsLost()
    reading = probe.read_gpus(nvml)

    data = json.loads(json.dumps(reading.to_json()))

    assert data == reading.to_json()
    assert (data["kind"], data["driver"], data["status"]) == ("gpus", "550.54.15", None)
    assert data["devices"][0]["error"] == "NVML could not read this GPU: GPU is lost"
    assert data["devices"][1]["power"] is None and data["devices"][1]["memory_total"] == 80 * GiB
    assert data["devices"][1]["processes"] == [
        {"pid": 4_000_003, "gpu_memory": None, "kind": "compute", "user": None, "command": None}
    ]


def test_process_gpu_memory_reads_one_pid_on_one_gpu():
    nvml = two_gpus(compute=[(os.getpid(), 5 * GiB), (4_000_004, 1)])
    nvml.gpus[0].compute = [(os.getpid(), 2 * GiB)]
    reading = probe.read_gpus(nvml)

    assert probe.process_gpu_memory(reading, os.getpid(), 1) == 5 * GiB
    assert probe.process_gpu_memory(reading, os.getpid(), 0) == 2 * GiB
    assert probe.process_gpu_memory(reading, 4_000_005, 1) is None
    assert probe.process_gpu_memory(reading, os.getpid(), 2) is None
    assert probe.process_gpu_memory(reading, os.getpid(), None) is None
    assert probe.process_gpu_memory(None, os.getpid(), 0) is None


# CUDA -> NVML index ---------------------------------------------------------------------------


@pytest.fixture
def cuda_env(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    return lambda **env: [monkeypatch.setenv(k, v) for k, v in env.items()]


def test_visible_devices_reorder_the_indices(cuda_env):
    cuda_env(CUDA_VISIBLE_DEVICES="1,0")
    nvml = two_gpus()

    assert [probe.cuda_to_nvml_index(i, nvml) for i in range(3)] == [1, 0, None]


def test_visible_devices_by_uuid_or_prefix(cuda_env):
    nvml = two_gpus(name="NVIDIA L4")  # mixed models: only UUIDs place them
    cuda_env(CUDA_VISIBLE_DEVICES=UUID_B)
    assert probe.cuda_to_nvml_index(0, nvml) == 1
    assert probe.cuda_to_nvml_index(1, nvml) is None
    cuda_env(CUDA_VISIBLE_DEVICES="GPU-bbbb, GPU-AAAA")
    assert [probe.cuda_to_nvml_index(i, nvml) for i in range(2)] == [1, 0]


def test_unset_visible_devices_trusts_the_given_uuid(cuda_env):
    nvml = two_gpus(name="NVIDIA L4")
    bare = UUID_B.removeprefix("GPU-").upper()  # torch's form: no prefix

    assert probe.cuda_to_nvml_index(0, nvml, cuda_uuid=bare) == 1
    assert probe.cuda_to_nvml_index(1, nvml, cuda_uuid=UUID_A) == 0
    assert probe.cuda_to_nvml_index(0, nvml, cuda_uuid="not-a-gpu") is None


def test_unset_visible_devices_without_uuid_maps_identity_only_when_the_order_is_known(cuda_env):
    assert [probe.cuda_to_nvml_index(i, two_gpus()) for i in range(3)] == [0, 1, None]
    mixed = two_gpus(name="NVIDIA L4")
    assert probe.cuda_to_nvml_index(0, mixed) is None  # FASTEST_FIRST may put either first
    cuda_env(CUDA_DEVICE_ORDER="PCI_BUS_ID")
    assert [probe.cuda_to_nvml_index(i, mixed) for i in range(2)] == [0, 1]


def test_a_mig_instance_maps_to_its_parent_gpu(cuda_env):
    mig = "MIG-cccccccc-9999-0000-1111-222222222222"
    nvml = two_gpus(migs=(mig,))
    cuda_env(CUDA_VISIBLE_DEVICES=mig)

    assert probe.cuda_to_nvml_index(0, nvml) == 1
    assert probe.cuda_to_nvml_index(0, nvml, cuda_uuid=mig.removeprefix("MIG-")) == 1


@pytest.mark.parametrize(
    "visible, cuda_index",
    [
        ("garbage", 0),
        ("", 0),
        ("-1", 0),
        ("7", 0),
        ("GPU-", 0),
        ("GPU-ffff", 0),
        ("0,garbage,1", 1),
        ("0,garbage,1", 2),
        ("0,1", -1),
        ("MIG-unknown", 0),
    ],
)
def test_garbage_visible_devices_give_none(cuda_env, visible, cuda_index):
    cuda_env(CUDA_VISIBLE_DEVICES=visible)

    assert probe.cuda_to_nvml_index(cuda_index, two_gpus()) is None


def test_entries_before_an_invalid_one_still_map(cuda_env):
    cuda_env(CUDA_VISIBLE_DEVICES="1,garbage,0")

    assert probe.cuda_to_nvml_index(0, two_gpus()) == 1


def test_mapping_without_nvml_is_none(cuda_env):
    assert probe.cuda_to_nvml_index(0, FakeNvml(Gpu(), init_error=NVMLError_DriverNotLoaded())) is None


# The poller ------------------------------------------------------------------------------------


def readings() -> tuple[threading.Semaphore, Callable[[GpuReading], None]]:
    """An on_reading callback, and a semaphore it releases at each reading: tests wait on it."""
    each = threading.Semaphore(0)
    return each, lambda reading: each.release()


def ended_by_itself(poller: probe.NvmlPoller, timeout: float = 2.0) -> bool:
    """Whether the poller's thread ends within `timeout` without stop() (NVML unavailable)."""
    poller._thread.join(timeout)
    return not poller.running


def test_the_poller_reads_at_most_once_per_interval():
    nvml = FakeNvml(Gpu())
    each, on_reading = readings()
    poller = probe.NvmlPoller(interval=0.01, nvml=nvml, on_reading=on_reading)  # clamped to the 0.25 s minimum
    assert poller.interval == probe.MIN_INTERVAL and poller.latest() is None

    with poller:
        assert each.acquire(timeout=2) and each.acquire(timeout=2), "two readings"
        first = poller.latest()
    calls = len(nvml.count_times)

    assert not poller.running
    assert nvml.count_times[1] - nvml.count_times[0] >= probe.MIN_INTERVAL - 0.01
    assert calls == 2 and isinstance(first, GpuReading) and first.devices[0].temperature == 45
    assert nvml.calls["nvmlInit"] == 1


def test_the_poller_stops_when_nvml_is_unavailable_and_keeps_the_reason():
    nvml = FakeNvml(init_error=NVMLError_DriverNotLoaded())
    poller = probe.NvmlPoller(interval=0.25, nvml=nvml).start()

    assert ended_by_itself(poller)

    assert poller.latest().status == "no NVIDIA driver is loaded (nvidia-smi would fail too)"
    assert nvml.calls["nvmlInit"] == 1
    poller.stop()


def test_the_poller_never_raises_into_its_thread(monkeypatch):
    def boom(nvml=None):
        raise RuntimeError("boom")

    monkeypatch.setattr(probe, "read_gpus", boom)
    raised = []
    monkeypatch.setattr(threading, "excepthook", raised.append)

    with probe.NvmlPoller(nvml=FakeNvml()) as poller:
        assert ended_by_itself(poller)

    assert poller.latest().status == "reading the GPUs failed: boom" and raised == []


# gputui watch --once -------------------------------------------------------------------------


def run_once(monkeypatch, nvml, as_json):
    monkeypatch.setattr(watch, "read_gpus", lambda: probe.read_gpus(nvml))
    out, err = io.StringIO(), io.StringIO()
    return watch.run_once(as_json, out, err), out.getvalue(), err.getvalue()


def test_watch_once_prints_one_line_per_gpu(monkeypatch, hidden_pids):
    hidden_pids[4_000_006] = psutil.NoSuchProcess(4_000_006)
    nvml = two_gpus(
        compute=[(4_000_006, None)],
        fails={
            "nvmlDeviceGetPowerUsage": NVMLError_NotSupported(),
            "nvmlDeviceGetTemperature": NVMLError_NotSupported(),
        },
    )
    nvml.gpus[0].compute = [(os.getpid(), 38 * GiB)]

    code, out, err = run_once(monkeypatch, nvml, as_json=False)

    header, first, second = out.splitlines()
    user = psutil.Process().username()
    assert code == 0 and err == "" and header.endswith("driver 550.54.15")
    assert first == (
        f"[0] NVIDIA H100 80GB HBM3 | 45°C | 87 % | 312 W / 700 W | 40.0 GiB / 80.0 GiB | "
        f"{user}/{os.getpid()}(38.0 GiB)"
    )
    assert second == "[1] NVIDIA H100 80GB HBM3 | n/a | 87 % | n/a / 700 W | 40.0 GiB / 80.0 GiB | 4000006(n/a)"


def test_watch_once_shows_a_broken_gpu_and_ascii_output(monkeypatch):
    nvml = two_gpus(fails={"nvmlDeviceGetHandleByIndex": NVMLError_GpuIsLost()})
    monkeypatch.setattr(watch, "read_gpus", lambda: probe.read_gpus(nvml))
    out = io.TextIOWrapper(io.BytesIO(), encoding="ascii")

    assert watch.run_once(False, out, io.StringIO()) == 0
    out.seek(0)
    lines = out.read().splitlines()

    assert lines[1].startswith("[0] NVIDIA H100 80GB HBM3 | 45C | ")
    assert lines[2] == "[1] error: NVML could not read this GPU: GPU is lost"


def test_watch_once_json_is_the_reading(monkeypatch):
    code, out, err = run_once(monkeypatch, two_gpus(), as_json=True)

    data = json.loads(out)
    assert code == 0 and err == "" and out.endswith("}\n") and out.startswith('{\n  "v": 1')
    assert [d["uuid"] for d in data["devices"]] == [UUID_A, UUID_B] and data["status"] is None


@pytest.mark.parametrize("as_json", [True, False])
def test_watch_once_without_a_driver_says_why_on_stderr(monkeypatch, as_json):
    code, out, err = run_once(monkeypatch, FakeNvml(init_error=NVMLError_DriverNotLoaded()), as_json)

    assert (code, out) == (1, "")
    assert err == "gputui: no NVIDIA driver is loaded (nvidia-smi would fail too)\n"
