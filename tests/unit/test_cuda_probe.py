"""The CUDA probe on a CPU machine: torch.cuda's functions replaced by a stand-in allocator, so the
probe's own code (the cap, the capacity, the allocator reads) and fit's use of it run as on a GPU."""

from __future__ import annotations

import pytest
import torch
from helpers import ConvNet, conv_batches, conv_step

import gputui
import gputui.engine.session as session_module
from gputui.probes import cuda
from gputui.probes.cuda import CudaProbe
from gputui.telemetry.describe import describe

GiB, MiB = 2**30, 2**20
DEVICE = torch.device("cuda", 0)


class FakeAllocator:
    """One device as torch.cuda reports it: `held` is reserved by live tensors (empty_cache keeps
    it), `cached` reserved and free (empty_cache returns it), `others` held by other processes;
    `peak` the most allocated since the last reset (a step's allocations move it), `retries` the
    allocator's."""

    def __init__(self, total=80 * GiB, held=2 * GiB, cached=GiB, others=0, fraction=1.0):
        self.total, self.held, self.cached, self.others, self.fraction = total, held, cached, others, fraction
        self.allocated = held
        self.peak = held + GiB
        self.retries = 3
        self.calls: list[str] = []

    @property
    def reserved(self) -> int:
        return self.held + self.cached

    def install(self, monkeypatch) -> FakeAllocator:
        def no_flattening(*args, **kwargs):
            raise AssertionError("memory_stats() flattens ~150 keys in Python: the probe must not call it")

        for name in ("memory_stats", "memory_allocated", "memory_reserved", "max_memory_allocated"):
            monkeypatch.setattr(torch.cuda, name, no_flattening)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Stand-in GPU")
        monkeypatch.setattr(torch.cuda, "mem_get_info", self.mem_get_info)
        monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", self.nested)
        monkeypatch.setattr(torch.cuda.memory, "memory_stats_as_nested_dict", self.nested)  # memory_stats' own
        monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", self.set_fraction)
        monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device=None: self.fraction)
        monkeypatch.setattr(torch.cuda, "empty_cache", self.empty_cache)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", self.reset_peak)
        return self

    def reset_peak(self, device=None):
        self.calls.append("reset_peak")
        self.peak = self.allocated

    def mem_get_info(self, device=None):
        return self.total - self.others - self.reserved, self.total

    def set_fraction(self, fraction, device=None):
        assert isinstance(fraction, float) and 0 <= fraction <= 1  # torch's own checks
        self.calls.append("set_fraction")
        self.fraction = fraction

    def empty_cache(self):
        self.calls.append("empty_cache")
        self.cached = 0

    def nested(self, device=None):
        def stat(current, peak=None):
            pool = {"current": current, "peak": current if peak is None else peak, "allocated": 0, "freed": 0}
            return {"all": pool, "large_pool": pool, "small_pool": dict.fromkeys(pool, 0)}

        return {
            "num_alloc_retries": self.retries,
            "num_ooms": 1,
            "allocated_bytes": stat(self.allocated, peak=self.peak),
            "reserved_bytes": stat(self.reserved),
            "active_bytes": stat(self.allocated + MiB),
            "inactive_split_bytes": stat(5 * MiB),
            "segment": stat(12),
            "requested_bytes": stat(self.allocated),
        }


@pytest.fixture
def gpu(monkeypatch):
    return FakeAllocator().install(monkeypatch)


def on_the_stand_in(monkeypatch):
    """fit on the CPU, with its session reading the stand-in GPU through a CudaProbe (the limit included)."""

    def probe(device, tracker, *, limit=None, nvml=None):
        return CudaProbe(DEVICE, tracker, limit=limit, nvml=nvml)

    monkeypatch.setattr(session_module, "for_device", probe)


def train(**options):
    model = ConvNet()
    return gputui.fit(model, conv_batches(2, 4), conv_step, torch.optim.SGD(model.parameters(), lr=0.1), **options)


# -- the figures: one nested read, what memory_stats() would have said -------------------------------


def test_a_reading_is_one_nested_read_that_agrees_with_memory_stats(gpu, monkeypatch):
    reading = CudaProbe(DEVICE).read()
    monkeypatch.undo()  # torch's own memory_stats() back, flattening the same nested dict
    monkeypatch.setattr(torch.cuda.memory, "memory_stats_as_nested_dict", gpu.nested)
    flat = torch.cuda.memory_stats(DEVICE)
    assert (reading.allocated, reading.reserved, reading.fragmented, reading.peak, reading.active) == (
        flat["allocated_bytes.all.current"],
        flat["reserved_bytes.all.current"],
        flat["inactive_split_bytes.all.current"],
        flat["allocated_bytes.all.peak"],
        flat["active_bytes.all.current"],
    )
    assert (reading.alloc_retries, reading.ooms) == (flat["num_alloc_retries"], flat["num_ooms"])


def test_cuda_not_initialized_reads_zero(gpu, monkeypatch):
    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", lambda device=None: {})  # torch's answer then
    reading = CudaProbe(DEVICE).read()
    assert (reading.allocated, reading.reserved, reading.peak, reading.alloc_retries) == (0, 0, 0, 0)


def test_fit_reads_the_allocator_without_memory_stats(gpu, monkeypatch, hub):
    on_the_stand_in(monkeypatch)
    result = train()  # the stand-in raises if a step reads memory_stats()/memory_allocated()/memory_reserved()
    assert result.steps == 2 and hub.latest().memory.reserved == gpu.reserved


class Clock:
    """time.monotonic() for the probe: each step of `stepping` takes `step_s`, and runs `each(n)` first."""

    def __init__(self, monkeypatch, step_s: float) -> None:
        self.now, self.step_s = 1000.0, step_s
        monkeypatch.setattr(cuda, "time", self)
        monkeypatch.setattr(
            session_module, "time", self
        )  # where a step's publish reads the clock the readings are paced by

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:  # a row's wall time
        return self.now

    def stepping(self, each):
        steps = [0]

        def step(model, batch):
            steps[0] += 1
            each(steps[0])
            self.now += self.step_s
            return conv_step(model, batch)

        return step


def fit_on_the_clock(step, steps: int):
    model = ConvNet()
    return gputui.fit(model, conv_batches(steps, 8), step, torch.optim.SGD(model.parameters(), lr=0.1))


def test_fast_steps_read_the_allocator_a_few_times_a_second_and_lose_no_peak(gpu, monkeypatch, hub):
    """Steps of 40 ms: a reading after every third (STEP_READ_S, 0.1 s), the steps between published
    with the last one; the peak is reset only after a reading, so a spike between two readings is in
    the next one, not lost."""
    on_the_stand_in(monkeypatch)
    clock = Clock(monkeypatch, 0.04)

    def spike_in_step_5(n):
        if n == 5:
            gpu.peak = max(gpu.peak, 9 * GiB)

    result = fit_on_the_clock(clock.stepping(spike_in_step_5), 9)
    assert result.steps == 9
    peaks = [s.memory.peak // GiB for s in hub.samples()]
    assert peaks == [2, 2, 2, 2, 2, 2, 9, 9, 9]  # read after steps 1, 4 and 7: the spike of step 5 at 7
    assert gpu.calls.count("reset_peak") == 4  # before step 1, then after each reading (steps 2, 5 and 8)


def test_a_cache_freed_is_read_after_the_next_step(gpu, monkeypatch, hub):
    """The cache freed (a key) is shown after the next step, however short the time since the last reading."""
    on_the_stand_in(monkeypatch)
    clock = Clock(monkeypatch, 0.001)

    def free_at_3(n):
        if n == 3:
            hub.controls.request("free_cache")

    fit_on_the_clock(clock.stepping(free_at_3), 6)
    reserved = [s.memory.reserved for s in hub.samples()]
    assert reserved == [3 * GiB] * 3 + [2 * GiB] * 3  # freed at the boundary after step 3, read after step 4


@pytest.mark.parametrize(
    ("retried", "halved_at"),
    [
        (lambda n: 1, 10),  # a retry every step
        (lambda n: n % 10 != 0, 10),  # in 9 steps of 10
        (lambda n: 3 * (n == 2), None),  # 3 in one step, then none
        (lambda n: n % 3 == 0, None),  # one step in 3
    ],
    ids=["every-step", "nine-in-ten", "one-burst", "every-third-step"],
)
def test_thrashing_is_retries_growing_in_readings_in_a_row_by_one_every_two_steps(
    gpu, monkeypatch, hub, retried, halved_at
):
    """Read after every third step (40 ms steps): thrashing is the allocator's retries grown in 3 readings
    in a row (after steps 4, 7 and 10; the first, after step 1, has none to compare with), by one every
    two steps at least: as a retry in each of 3 steps when every step is read."""
    on_the_stand_in(monkeypatch)
    clock = Clock(monkeypatch, 0.04)

    def retry(n):
        gpu.retries += int(retried(n))

    result = fit_on_the_clock(clock.stepping(retry), 12)
    halved = [(e.step, e["micro_batch"], e["micro_batch_to"]) for e in result.events if e.name == "thrashing"]
    assert halved[:1] == ([(halved_at, 8, 4)] if halved_at else [])


# -- the capacity: what this process can have ----------------------------------------------------


def test_capacity_is_free_plus_what_this_process_holds_not_the_device(monkeypatch):
    gpu = FakeAllocator(total=80 * GiB, held=6 * GiB, cached=4 * GiB, others=50 * GiB).install(monkeypatch)
    probe = CudaProbe(DEVICE)
    assert probe.capacity() == probe.read().capacity == 30 * GiB  # 20 free + 10 reserved; 50 are others'
    gpu.empty_cache()  # reserved falls, free rises by as much: what the process can have is the same
    monkeypatch.setattr(cuda, "FREE_MAX_AGE", -1.0)  # read the device again
    assert probe.capacity() == 30 * GiB and probe.read().device_free == 24 * GiB


def test_the_cap_bounds_the_capacity_only_below_what_is_there(monkeypatch):
    FakeAllocator(total=80 * GiB, held=2 * GiB, cached=0, others=50 * GiB).install(monkeypatch)
    assert CudaProbe(DEVICE, limit=8 * GiB).capacity() == 8 * GiB
    assert CudaProbe(DEVICE, limit=40 * GiB).capacity() == 30 * GiB  # the cap asks for more than is free


def test_micro_batch_auto_aims_at_the_capacity_the_probe_gives(monkeypatch, hub):
    FakeAllocator(total=80 * GiB, held=GiB, cached=0, others=75 * GiB).install(monkeypatch)
    on_the_stand_in(monkeypatch)
    result = train(micro_batch="auto")
    (chosen,) = [e for e in result.events if e.name == "micro_batch_changed"]
    assert "of 5.00 GiB" in chosen["reason"], chosen["reason"]  # 4 free + 1 held, not the device's 80


# -- the cap: set, the cache emptied under it, lifted at the end -----------------------------------


def test_the_cap_is_lifted_when_fit_ends(gpu, monkeypatch, hub):
    gpu.fraction = 0.5  # the script's own cap, before fit's
    on_the_stand_in(monkeypatch)
    during = []
    model = ConvNet()

    def step(model, batch):
        during.append(gpu.fraction)
        return conv_step(model, batch)

    gputui.fit(model, conv_batches(2, 4), step, torch.optim.SGD(model.parameters(), lr=0.1), gpu_memory_limit="8GiB")
    assert set(during) == {0.1} and gpu.fraction == 0.5


def test_the_cap_is_lifted_when_fit_fails(gpu, monkeypatch, hub):
    on_the_stand_in(monkeypatch)
    model = ConvNet()

    def step(model, batch):
        raise RuntimeError("the script's bug")

    with pytest.raises(RuntimeError, match="the script's bug"):
        gputui.fit(model, conv_batches(2, 4), step, torch.optim.SGD(model.parameters()), gpu_memory_limit="8GiB")
    assert gpu.fraction == 1.0


def test_without_a_getter_the_cap_is_lifted_to_the_whole_device(gpu, monkeypatch, hub):
    monkeypatch.delattr(torch.cuda, "get_per_process_memory_fraction")  # an older torch
    on_the_stand_in(monkeypatch)
    gpu.fraction = 0.3  # invisible without the getter
    train(gpu_memory_limit="8GiB")
    assert gpu.fraction == 1.0


def test_the_cache_is_emptied_under_the_cap(gpu, monkeypatch, hub):
    on_the_stand_in(monkeypatch)
    result = train(gpu_memory_limit="8GiB")
    assert gpu.calls[:2] == ["set_fraction", "empty_cache"]  # cached blocks would be reused past the cap
    assert not [e for e in result.events if e.name == "memory_limit"]  # 2 GiB held, under 8


def test_memory_held_past_the_cap_is_said_at_the_start(monkeypatch, hub):
    gpu = FakeAllocator(held=10 * GiB, cached=6 * GiB).install(monkeypatch)
    on_the_stand_in(monkeypatch)
    result = train(gpu_memory_limit="8GiB")
    (said,) = [e for e in result.events if e.name == "memory_limit"]
    assert (said["limit"], said["reserved"]) == (8 * GiB, 10 * GiB) and gpu.cached == 0
    assert describe(said).startswith("GPU memory limit 8.00 GiB, but 10.0 GiB stays reserved")
    assert [e.name for e in hub.events()][0] == "memory_limit"  # on the timeline and the progress line


def test_a_cap_larger_than_the_device_is_refused_and_sets_nothing(gpu, monkeypatch, hub):
    on_the_stand_in(monkeypatch)
    with pytest.raises(ValueError, match="gpu_memory_limit is larger than the device"):
        train(gpu_memory_limit="100GiB")
    assert gpu.fraction == 1.0 and gpu.calls == []
