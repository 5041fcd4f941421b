"""OOM recovery: the same batch is retried with half the micro-batch, and nothing is counted twice."""

import gc
import random
import threading
import weakref

import pytest
import torch
from helpers import (
    ConvNet,
    EventSeen,
    Sink,
    assert_same_weights,
    conv_batches,
    conv_step,
    on_event,
    plain_loop,
    twins,
)
from torch import nn
from torch.nn import functional as F

import gputui
from gputui.engine import oom
from gputui.engine.oom import Generators, is_oom
from gputui.engine.recovery import MAX_RETRIES
from gputui.probes import host


class FailOn:
    """A step() that raises an OOM on chosen calls, in forward or (through a grad hook) in backward."""

    def __init__(self, calls, phase="forward", exc=None):
        self.calls, self.phase, self.count = set(calls), phase, 0
        self.exc = exc or (lambda: torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
        self.sizes = []

    def __call__(self, model, batch):
        self.count += 1
        self.sizes.append(len(batch[0]))
        loss = conv_step(model, batch)
        if self.count in self.calls:
            if self.phase == "forward":
                raise self.exc()
            loss.register_hook(lambda g: (_ for _ in ()).throw(self.exc()))
        return loss


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.05)


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_counters_and_scheduler_exact_after_recovery(phase):
    batches = conv_batches(5, 8)
    ref, model = twins(ConvNet)
    plain_loop(ref, batches, conv_step, sgd, scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 1, 0.9))
    step = FailOn({3, 5}, phase)  # step 3's first try, then one micro-batch of its retry
    opt = sgd(model)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.9)
    result = gputui.fit(model, batches, step, opt, scheduler=sched)
    assert (result.steps, result.samples, sched.last_epoch) == (5, 40, 5)
    assert result.ooms_recovered == 2 and result.micro_batch == 2
    assert step.sizes[:6] == [8, 8, 8, 4, 4, 2]
    recovered = [e for e in result.events if e.name == "oom_recovered"]
    assert [(e.step, e["phase"], e["micro_batch"], e["micro_batch_to"]) for e in recovered] == [
        (2, phase, 8, 4),
        (2, phase, 4, 2),
    ]
    assert "CUDA out of memory" in recovered[0]["message"]
    assert_same_weights(model, ref)


def test_runtime_errors_that_mean_oom_are_recovered_others_are_not():
    for text in (
        "CUDA error: out of memory",
        "MPS backend out of memory (MPS allocated: 1 GB)",
        "DefaultCPUAllocator: can't allocate memory",
    ):
        assert is_oom(RuntimeError(text))
    assert not is_oom(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    model = ConvNet()
    result = gputui.fit(
        model, conv_batches(2, 4), FailOn({1}, exc=lambda: RuntimeError("CUDA error: out of memory")), sgd(model)
    )
    assert result.ooms_recovered == 1
    with pytest.raises(ValueError, match="not memory"):
        gputui.fit(model, conv_batches(2, 4), FailOn({1}, exc=lambda: ValueError("not memory")), sgd(model))


CUDNN = "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a non-contiguous input."


def cuda_memory(monkeypatch, reserved, free, fraction=1.0, total=100):
    """Stand-ins for the CUDA readings taken when cuDNN says NOT_SUPPORTED (no GPU here)."""
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: reserved)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device=None: fraction)


@pytest.mark.parametrize(
    ("reserved", "free", "fraction"),
    [(95, 5, 1.0), (45, 50, 0.5)],  # near what the device has; near a cap of half of it
)
def test_cudnn_not_supported_with_memory_near_full_is_recovered_as_an_oom(monkeypatch, reserved, free, fraction):
    cuda_memory(monkeypatch, reserved, free, fraction)
    model = ConvNet()
    step = FailOn({1}, exc=lambda: RuntimeError(CUDNN))
    result = gputui.fit(model, conv_batches(2, 4), step, sgd(model))
    assert result.ooms_recovered == 1 and result.steps == 2 and step.sizes[:2] == [4, 2]


@pytest.mark.parametrize("cuda", [True, False])
def test_cudnn_not_supported_with_memory_far_from_full_is_the_error_it_is(hub, monkeypatch, cuda):
    """A configuration cuDNN has no kernel for: halving it down to one sample would say "not even one
    sample fits", which is not what happened."""
    cuda_memory(monkeypatch, reserved=60, free=40, fraction=0.9)  # 60 of 90: far from it
    if not cuda:
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    model = ConvNet()
    step = FailOn({1}, exc=lambda: RuntimeError(CUDNN))
    with pytest.raises(gputui.FitError, match=r"^cuDNN has no kernel for this configuration") as info:
        gputui.fit(model, conv_batches(2, 4), step, sgd(model))
    assert str(info.value).endswith(f"[{CUDNN}]")  # cuDNN's own line, and the error it was the cause
    assert isinstance(info.value.__cause__, RuntimeError) and step.sizes == [4]
    assert not [e for e in hub.events() if e.name in ("oom_recovered", "oom")]


def test_floor_at_micro_batch_one_ends_the_run_with_a_clear_error(hub):
    model = ConvNet()
    with pytest.raises(gputui.FitError, match="micro-batch 1: not even one sample fits") as info:
        gputui.fit(model, conv_batches(3, 8), FailOn(range(1, 100)), sgd(model))
    assert info.value.result.steps == 0
    names = [e.name for e in hub.events()]
    assert names == ["oom_recovered"] * 3 + ["oom", "error", "part_ended"]  # 8 -> 4 -> 2 -> 1, then the floor


def test_at_micro_batch_one_fragmentation_is_named_when_holes_are_a_fifth_of_what_is_reserved(monkeypatch):
    """On an H200 under a cap a step ran out at one sample with 121 MiB free in split segments: the error
    says so, and what lets the allocator do without (expandable segments); without holes it does not."""
    from gputui.probes.cpu import CpuProbe
    from gputui.telemetry.sample import Memory

    MiB = 1 << 20
    for holes, named in ((121 * MiB, True), (0, False)):
        reading = Memory(device="cuda:0", allocated=141 * MiB, reserved=262 * MiB, fragmented=holes)
        monkeypatch.setattr(CpuProbe, "read", lambda self, reading=reading: reading)
        model = ConvNet()
        with pytest.raises(gputui.FitError, match="micro-batch 1: not even one sample fits") as info:
            gputui.fit(model, conv_batches(1, 8), FailOn(range(1, 100)), sgd(model))
        said = "121 MiB of the 262 MiB reserved is free but split between live blocks (fragmentation)"
        assert (said in str(info.value)) is named, str(info.value)
        assert ("expandable_segments:True" in str(info.value).split("(CUDA")[0]) is named


def test_an_oom_that_ends_a_torchrun_job_names_the_fragmentation_too(monkeypatch):
    """Under FSDP any OOM ends the job, and a DDP rank's synced backward cannot be replayed: their errors
    name the holes as one process's does (expandable segments is the usual fix there); an error that
    is not an OOM does not."""
    from gputui.engine.core import Core
    from gputui.engine.oom import OomInfo
    from gputui.engine.options import FitOptions
    from gputui.probes.cpu import CpuProbe
    from gputui.telemetry.sample import Memory

    MiB = 1 << 20
    reading = Memory(device="cuda:0", allocated=141 * MiB, reserved=262 * MiB, fragmented=121 * MiB)
    monkeypatch.setattr(CpuProbe, "read", lambda self: reading)
    model = ConvNet()
    core = Core(model, conv_step, sgd(model), FitOptions())
    with core.running():
        recovery, exc = core.recovery, torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 16.00 MiB")
        fsdp = str(recovery.endings.fsdp_failure(exc, "backward", 1, 1))
        synced = str(recovery.endings.synced_failure(OomInfo("backward", str(exc), 1, 0), True, True, 1))
        other = str(recovery.endings.synced_failure(OomInfo("backward", "ValueError: no", 1, 0), True, False, 1))
    said = "121 MiB of the 262 MiB reserved is free but split between live blocks (fragmentation)"
    assert said in fsdp and fsdp.endswith("[CUDA out of memory. Tried to allocate 16.00 MiB]"), fsdp
    assert said in synced and "so every rank stops. 121 MiB" in synced, synced
    assert said not in other and other.endswith("so every rank stops"), other


def test_oom_in_optimizer_step_stops_cleanly():
    model = ConvNet()

    class Greedy(torch.optim.SGD):
        calls = 0

        def step(self, closure=None):
            self.calls += 1
            if self.calls > 1:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
            return super().step(closure)

    with pytest.raises(gputui.FitError, match=r"inside optimizer.step\(\) at step 2: not safe to retry") as info:
        gputui.fit(model, conv_batches(3, 4), conv_step, Greedy(model.parameters(), lr=0.1))
    assert info.value.result.steps == 1


def test_manual_mode_waits_for_a_remedy_then_retries(hub):
    model = ConvNet()
    step = FailOn({2})

    helper = on_event(hub, "oom", lambda: hub.controls.request("halve_batch", source="test"))
    # planning="asked": no plan for the dialog, whose trace would run the step (and count its calls) meanwhile
    result = gputui.fit(model, conv_batches(3, 8), step, sgd(model), auto_recover=False, planning="asked")
    helper.join(5)
    assert (result.steps, result.samples, result.micro_batch, result.ooms_recovered) == (3, 24, 4, 1)
    names = [e.name for e in result.events]
    assert names == ["oom", "paused", "micro_batch_changed", "resumed"]
    assert result.events[0]["waiting"] is True and result.events[0]["phase"] == "forward"
    assert step.sizes == [8, 8, 4, 4, 4, 4]  # step 1, step 2 fails, its retry, step 3


def test_manual_mode_retry_cap(hub):
    model = ConvNet()
    stop = threading.Event()
    paused = EventSeen("paused")
    hub.add_sink(paused)

    def keep_resuming():  # the user who presses "retry" at every pause, whatever happens
        while paused.each.acquire(timeout=10) and not stop.is_set():
            hub.controls.request("resume")

    t = threading.Thread(target=keep_resuming, daemon=True)
    t.start()
    try:
        with pytest.raises(gputui.FitError, match=f"gave up after {MAX_RETRIES} out-of-memory errors"):
            gputui.fit(model, conv_batches(1, 8), FailOn(range(1, 1000)), sgd(model), auto_recover=False)
    finally:
        stop.set()
        paused.each.release()  # wakes it to see the stop
        t.join(5)


def test_rng_restored_so_a_retry_replays_the_same_dropout(hub):
    batches = conv_batches(3, 6)

    def factory():
        return nn.Sequential(nn.Flatten(), nn.Linear(108, 32), nn.Dropout(0.5), nn.Linear(32, 5))

    def step(model, batch):
        return F.cross_entropy(model(batch[0]), batch[1])

    ref, model = twins(factory)
    torch.manual_seed(7)
    plain_loop(ref, batches, step, sgd)

    calls = []

    def failing(model, batch):
        loss = step(model, batch)  # dropout has drawn from the RNG before the OOM
        calls.append(1)
        if len(calls) == 2:
            raise torch.OutOfMemoryError("out of memory")
        return loss

    on_event(hub, "oom", lambda: hub.controls.request("resume"))
    torch.manual_seed(7)
    result = gputui.fit(model, batches, failing, sgd(model), auto_recover=False, planning="asked")  # as above
    assert len(calls) == 4 and result.micro_batch == 6  # retried with the same micro-batch
    assert_same_weights(model, ref, atol=0, rtol=0)


held_random = random.random  # bound before any fit: past the trap on random._inst


@pytest.mark.parametrize("first_draw", [1, 7])  # from the first step, or from an unchecked step on
def test_draws_through_a_function_bound_before_fit_are_caught_at_a_checked_step(hub, first_draw, monkeypatch):
    """`from random import random` holds the C method, which the lazy save cannot see: comparing
    the state around the first steps and every CHECK_EVERY-th finds it, and every step saves."""
    draws: list[tuple[int, float]] = []
    calls = []

    def step(model, batch):
        calls.append(1)
        n = len(calls)
        loss = conv_step(model, batch)
        if n >= first_draw:
            draws.append((n, held_random()))
        if n == 12:  # a step well after the generator was seen drawing (step 10 checks, at the latest)
            raise torch.OutOfMemoryError("out of memory")
        return loss

    monkeypatch.setattr(Generators, "CHECK_EVERY", 10)
    monkeypatch.setattr(Generators, "CHECK_S", 0.0)
    model = ConvNet()
    result = gputui.fit(model, conv_batches(14, 4), step, sgd(model))
    assert result.steps == 14 and result.ooms_recovered == 1
    by_call = dict(draws)
    assert by_call[13] == by_call[12]  # the replay drew what the failed attempt drew
    assert by_call[14] != by_call[12]


@pytest.mark.parametrize(
    ("check_s", "checked"),
    [(0.0, [1, 2, 3, *range(4, 21, 2)]), (1.0, [1, 2, 3, 8, 12, 16, 20]), (3600.0, [1, 2, 3])],
)
def test_the_state_is_checked_every_check_every_th_step_at_most_once_a_check_s(monkeypatch, check_s, checked):
    """The first three steps, then every CHECK_EVERY-th while CHECK_S has passed since the last checked
    step: a loop of fast steps pays a NumPy state read (~30 us, twice) a second, not one every 50 steps.
    Steps 0.3 s apart on a clock of the test's."""
    monkeypatch.setattr(Generators, "CHECK_EVERY", 2)
    monkeypatch.setattr(Generators, "CHECK_S", check_s)
    now = [0.0]
    monkeypatch.setattr(oom, "monotonic", lambda: now[0])
    generators = Generators(torch.device("cpu"))
    reads = []
    monkeypatch.setattr(generators.python, "get", lambda: reads.append(generators._starts) or random.getstate())
    for step in range(1, 21):
        now[0] = 0.3 * step
        generators.start()
        generators.end()
    generators.close()
    assert sorted(set(reads)) == checked, reads  # each checked step reads the state at its start and end


def test_host_generators_are_saved_only_by_steps_that_draw_from_them():
    np = pytest.importorskip("numpy")
    gen = Generators(torch.device("cpu"))
    saved = []
    for i in range(8):
        gen.start()
        torch.rand(3)  # torch's generator only
        if i == 5:
            random.shuffle([1, 2, 3])
        if i == 6:
            np.random.rand()
        saved.append((gen.python.step_start(i + 1) is not None, gen.numpy.step_start(i + 1) is not None))
        gen.end()
    assert saved == [(True, True)] * 3 + [(False, False)] * 2 + [(True, False), (False, True), (False, False)]
    assert not gen.python.every_step and not gen.numpy.every_step
    gen.close()  # fit returns: the module and the generator are as the script left them
    assert type(random._inst) is random.Random and random.random == random._inst.random
    assert type(np.random) is type(np)


def test_a_draw_past_the_trap_before_a_trapped_one_is_found_and_replayed():
    """`from random import random` draws past the trap; a trapped draw after it in the same step saves a
    state already moved. A checked step finds that (the state at the trapped draw differs from its
    start), and from then on every step saves at its start, so a later replay draws the same."""
    random.seed(2)
    gen = Generators(torch.device("cpu"))
    gen.start()
    held_random(), random.random()  # step 1 (checked): past the trap, then through it
    gen.end()
    assert gen.python.every_step
    for _ in range(3):
        gen.start()
        gen.end()
    gen.start()  # step 5: not checked
    first = (held_random(), random.random())
    gen.restore()
    assert (held_random(), random.random()) == first
    gen.end()
    gen.close()


held_gauss = random.gauss  # bound before any fit, as `from random import gauss` is


@pytest.mark.parametrize("gauss", [random.gauss, held_gauss], ids=["module", "bound-before"])
def test_a_replay_gets_back_the_gaussian_that_gauss_kept_before_the_step(gauss):
    """gauss() draws two values and keeps one for its next call, which then draws nothing: a step whose
    first draw is that kept value must still find it again when replayed, however gauss was reached."""
    random.seed(1)
    random.gauss(0, 1)  # keeps a second value
    gen = Generators(torch.device("cpu"))
    for _ in range(5):  # past the first steps, whose states are compared around them (and saved)
        gen.start()
        gen.end()
    gen.start()
    first = (gauss(0, 1), random.random())
    gen.restore()
    assert (gauss(0, 1), random.random()) == first
    gen.end()
    gen.close()


def test_failed_attempt_memory_is_released_before_the_retry():
    refs = []
    alive_at_retry = []

    def step(model, batch):
        if refs:
            alive_at_retry.append(refs[0]() is not None)
        loss = conv_step(model, batch)
        if not refs:
            big = torch.ones(1000, 1000) * loss  # an activation of the failed attempt
            refs.append(weakref.ref(big))
            raise torch.OutOfMemoryError("out of memory")
        return loss

    model = ConvNet()
    result = gputui.fit(model, conv_batches(1, 4), step, sgd(model))
    assert alive_at_retry and not any(alive_at_retry)
    assert result.events[0]["leaked"] == 0


def test_fifty_ooms_leave_nothing_behind_without_a_full_collection(hub, monkeypatch):
    """Each failed attempt holds 8 MiB kept alive only by a reference cycle once its frames are cleared:
    it is gone before the retry, found by the young generations' collection (a full one costs ~100 ms
    with torch loaded, and malloc_trim would hand back pages the retry faults in again). The tracked
    bytes come back to the same figure after each of 50 recoveries, and RSS stays flat."""
    generations = []
    collect = gc.collect
    monkeypatch.setattr(gc, "collect", lambda generation=2: generations.append(generation) or collect(generation))
    trimmed = []
    monkeypatch.setattr(host, "release_free_memory", lambda: trimmed.append(1) or (0, 0))
    calls, held, alive_at_retry = [0], [], []

    def step(model, batch):
        calls[0] += 1
        if held:
            alive_at_retry.append(held.pop()() is not None)
        loss = conv_step(model, batch)
        if calls[0] % 2 == 0:
            cycle = [torch.ones(2**21) * loss]  # 8 MiB of the failed attempt
            cycle.append(cycle)
            held.append(weakref.ref(cycle[0]))
            raise torch.OutOfMemoryError("simulated: CUDA out of memory")
        return loss

    rss, tracked = [], []

    class Resume(Sink):  # the user who resumes at once, on the training thread
        def on_event(self, event):
            if event.name == "paused":
                hub.controls.request("resume")

        def on_sample(self, sample):
            rss.append(host.rss())  # fresh, not the per-step cached reading
            tracked.append(sample.memory.allocated)

    hub.add_sink(Resume())
    model = ConvNet()
    result = gputui.fit(model, conv_batches(51, 4), step, sgd(model), auto_recover=False, planning="asked")
    ooms = [e for e in result.events if e.name == "oom"]
    assert len(ooms) == 50 and result.steps == 51 and result.ooms_recovered == 50
    assert alive_at_retry == [False] * 50
    assert {e["leaked"] for e in ooms} == {0} and len(set(tracked)) == 1
    assert max(rss[5:]) - min(rss[5:]) < 64 * 2**20  # a leak would add 8 MiB an OOM: 360 MiB
    assert 2 not in generations and not trimmed
