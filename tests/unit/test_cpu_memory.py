"""Tracked CPU bytes are real, and the budget raises a real torch.OutOfMemoryError inside the step."""

import time

import pytest
import torch
from helpers import ConvNet, conv_batches, conv_step
from torch import nn

import gputui
from gputui import probes
from gputui.probes.cpu import CpuProbe, StateTracker


def test_counts_parameters_gradients_optimizer_state_exactly():
    model = nn.Sequential(nn.Linear(100, 50), nn.ReLU(), nn.Linear(50, 10))
    params = (100 * 50 + 50 + 50 * 10 + 10) * 4
    opt = torch.optim.Adam(model.parameters())
    t = StateTracker(model, opt, None)
    assert (t.params, t.grads, t.optimizer_bytes, t.activations) == (params, 0, 0, 0)
    x = torch.randn(8, 100)
    with t.saving():
        loss = model(x).sum()
    # saved for backward: the input (8x100), the first output (8x50) kept by ReLU and the ReLU output;
    # weights are parameters and never count as activations
    assert t.activations >= (8 * 100 + 8 * 50) * 4
    loss.backward()
    t.end_micro_batch()
    assert t.grads == params and t.activations == 0
    opt.step()
    t.refresh_optimizer()
    assert t.optimizer_bytes == 2 * params + 4 * 4  # exp_avg, exp_avg_sq, and a 4-byte step per parameter
    opt.zero_grad(set_to_none=True)
    t.reset()
    assert t.grads == 0 and t.total == params + t.optimizer_bytes
    t.close()


@pytest.mark.parametrize("budget", [None, 10**6])
def test_a_lazy_modules_parameters_count_once_made(budget):
    """An optimizer made before a Lazy module's first forward (as PyTorch allows) holds parameters not
    made yet: they count nothing until made, then as parameters (never as activations) from the next step."""
    model = nn.Sequential(nn.LazyLinear(32), nn.ReLU(), nn.LazyLinear(2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    t = StateTracker(model, opt, budget)
    assert t.params == 0
    for _ in range(2):
        t.start_step()
        with t.saving():
            loss = model(torch.randn(4, 8)).sum()
        loss.backward()
        t.end_micro_batch()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t.reset()
    params = (8 * 32 + 32 + 32 * 2 + 2) * 4
    assert t.params == params
    t.start_step()
    with t.saving():
        loss = model(torch.randn(4, 8)).sum()
    assert t.activations == (4 * 8 + 4 * 32) * 4  # the input and ReLU's output; the weights are parameters
    loss.backward()
    t.end_micro_batch()
    assert t.grads == params
    t.close()


def test_lazy_parameters_made_are_counted_while_a_branch_not_run_stays_lazy():
    class Branches(nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.head, self.unused = nn.LazyLinear(16), nn.Linear(16, 2), nn.LazyLinear(3)

        def forward(self, x):
            return self.head(self.used(x))

    model = Branches()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    t = StateTracker(model, opt, None)
    assert t.params == (16 * 2 + 2) * 4
    for _ in range(2):
        t.start_step()
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
    assert t.params == (8 * 16 + 16 + 16 * 2 + 2) * 4
    t.close()


def test_views_of_one_storage_count_once():
    model = nn.Linear(4, 4)
    t = StateTracker(model, torch.optim.SGD(model.parameters(), lr=0.1), None)
    base = torch.randn(64, 4, requires_grad=True)
    with t.saving():
        y = (base[:32] * base[32:]).sum()
    assert t.activations == 64 * 4 * 4  # two views of `base`: its storage once
    y.backward()
    t.close()


@pytest.mark.parametrize("budget, phase", [(3000, "forward"), (4500, "backward")])
def test_budget_raises_real_oom_in_the_phase_where_it_is_crossed(budget, phase):
    model = nn.Linear(20, 20)  # 1680 bytes of parameters
    t = StateTracker(model, torch.optim.SGD(model.parameters(), lr=0.1), budget)
    with pytest.raises(torch.OutOfMemoryError, match=f"CPU memory budget exceeded in {phase}"):
        with t.saving():
            loss = model(torch.randn(16, 20)).pow(2).sum()
        loss.backward()
    t.close()


def test_fit_publishes_real_changing_cpu_readings(hub, monkeypatch):
    monkeypatch.setattr(probes, "STEP_READ_S", 0.0)  # a reading after every step
    model = ConvNet()
    gputui.fit(model, conv_batches(6, 8), conv_step, torch.optim.Adam(model.parameters()), memory_budget="64MiB")
    samples = hub.samples()
    assert [s.step for s in samples] == [1, 2, 3, 4, 5, 6]
    m1, m2 = samples[0].memory, samples[-1].memory
    params = sum(p.numel() * 4 for p in model.parameters())
    assert m1.device == "cpu" and m1.params == params and m1.capacity == 64 * 2**20
    assert m1.optimizer == 2 * params + 4 * len(list(model.parameters()))
    assert m2.allocated == params + m2.optimizer and m2.grads == 0 and m2.activations == 0
    assert m2.peak > m2.allocated + params  # at the peak gradients and activations were alive
    assert m1.rss > 50 * 2**20 and m1.reserved is None and m1.fragmented is None
    assert samples[0].memory.peak < samples[1].memory.peak  # the optimizer state appeared in step 1


def test_readings_between_steps_keep_the_largest_step_peak_for_the_next(monkeypatch):
    """Steps faster than STEP_READ_S are read a few times a second (as on CUDA): the steps between carry the
    last reading, and the next reading's peak is the largest of the steps since, not only the last one's."""
    monkeypatch.setattr(probes, "STEP_READ_S", 3600.0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    t = StateTracker(model, opt, None)
    probe = CpuProbe(t)
    first = tracked_step(t, model, opt, torch.randn(4, 64), "small")[1]
    assert probe.step_reading(time.monotonic()).peak == first  # a run's first step is read
    big = tracked_step(t, model, opt, torch.randn(256, 64), "big")[1]
    assert probe.step_reading(time.monotonic()) is None  # within STEP_READ_S: the last reading stands
    small = tracked_step(t, model, opt, torch.randn(4, 64), "small")[1]
    assert probe.step_reading(time.monotonic()) is None and small < big
    assert probe.read().peak == big  # the big step between readings, not the small one after it
    tracked_step(t, model, opt, torch.randn(4, 64), "small")
    reading = probe.step_reading(
        time.monotonic()
    )  # a reading outside the steps: the next step's is made, its peak its own
    assert reading is not None and reading.peak == small
    probe.free_cache()
    tracked_step(t, model, opt, torch.randn(4, 64), "small")
    assert (
        probe.step_reading(time.monotonic()) is not None
    )  # what freeing the cache changed is shown after the next step
    t.close()


def peak_of(**kwargs):
    torch.manual_seed(0)
    model = ConvNet(channels=16, blocks=4)
    result = gputui.fit(model, conv_batches(2, 32), conv_step, torch.optim.SGD(model.parameters(), lr=0.01), **kwargs)
    return result, gputui.telemetry.hub.current().latest().memory.peak


def test_each_remedy_lowers_the_step_peak():
    _, base = peak_of()
    _, halved = peak_of(micro_batch=16)
    _, ckpt = peak_of(checkpointing=True)
    _, bf16 = peak_of(amp="bf16")
    assert halved < 0.7 * base and ckpt < 0.7 * base and bf16 < 0.8 * base


def tracked_step(t, model, opt, x, shape):
    """One step as fit drives the tracker; returns the peak it reports."""
    t.start_step(shape)
    with t.saving():
        loss = model(x).pow(2).mean()
    loss.backward()
    t.end_micro_batch()
    opt.step()
    t.refresh_optimizer()
    opt.zero_grad(set_to_none=True)
    t.reset()
    return t.counting, t.peak


def test_without_a_budget_a_step_shaped_like_a_counted_one_reports_its_peak_uncounted(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr("gputui.probes.cpu.time.monotonic", lambda: clock[0])
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    opt = torch.optim.Adam(model.parameters())
    t = StateTracker(model, opt, None)
    big, small = torch.randn(64, 32), torch.randn(16, 32)
    tracked_step(t, model, opt, big, ("big",))  # the optimizer state appears: a new shape next time
    counted, peak = tracked_step(t, model, opt, big, ("big",))
    again, same = tracked_step(t, model, opt, big, ("big",))
    assert counted and not again and same == peak
    changed, lower = tracked_step(t, model, opt, small, ("small",))  # e.g. the micro-batch halved
    assert changed and lower < peak
    clock[0] += 0.5
    assert tracked_step(t, model, opt, small, ("small",)) == (False, lower)
    clock[0] += 1.0  # RECOUNT_S passed: counted again, whatever the shape
    assert tracked_step(t, model, opt, small, ("small",)) == (True, lower)
    t.close()


def test_with_a_budget_every_step_counts(monkeypatch):
    model = nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    t = StateTracker(model, opt, 10**6)
    x = torch.randn(4, 8)
    assert [tracked_step(t, model, opt, x, ("same",))[0] for _ in range(3)] == [True, True, True]
    t.close()


def sliced_data(width=512):
    """A data set held as one tensor (1,280 samples, 2.5 MiB) cut into 64-sample batches by slicing,
    as small scripts do: every batch is a view of it."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(1280, width, generator=g), torch.randn(1280, 1, generator=g)
    return x, [(x[i : i + 64], y[i : i + 64]) for i in range(0, 1280, 64)]


def mse_step(model, batch):
    return nn.functional.mse_loss(model(batch[0]), batch[1])


@pytest.mark.parametrize("micro_batch", [1, None])
def test_a_data_set_sliced_into_batches_is_not_counted_as_the_steps_activations(hub, micro_batch):
    data, batches = sliced_data()
    model = nn.Sequential(nn.Linear(512, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    result = gputui.fit(model, batches, mse_step, opt, micro_batch=micro_batch, memory_budget="2MiB")
    assert result.steps == 20 and result.ooms_recovered == 0
    params = sum(p.numel() * 4 for p in model.parameters())
    peak = max(s.memory.peak for s in hub.samples())
    assert peak - 2 * params < data.nbytes / 10, "parameters, gradients and the step's own activations"


def test_activations_a_step_makes_from_a_sliced_data_set_still_count(hub):
    _, batches = sliced_data()
    model = nn.Sequential(nn.Linear(512, 32), nn.ReLU(), nn.Linear(32, 1))

    def wide_step(model, batch):  # saves 64 x 16,384 floats (4 MiB) at micro-batch 64, 64 KiB at 1
        return model(batch[0]).repeat(1, 16384).exp().mean()

    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    result = gputui.fit(model, batches[:3], wide_step, opt, memory_budget="2MiB")
    assert result.ooms_recovered >= 1 and result.micro_batch is not None and result.micro_batch < 64
    assert result.steps == 3
