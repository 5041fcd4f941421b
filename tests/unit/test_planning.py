"""fit's planner: recovery that picks the micro-batch that fits, micro_batch="auto", and the plan table."""

import copy
import time

import pytest
import torch
from helpers import ConvNet, RequestAt, assert_same_weights, conv_batches, conv_step, own_process
from torch import nn
from torch.nn import functional as F

import gputui
from gputui import probes
from gputui.plan import planner as planning
from gputui.plan import predict
from gputui.probes.cpu import state_tensors, tensor_bytes


class Wide(nn.Module):
    """Activations that grow with the micro-batch, over parameters that do not."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(4))
        self.head = nn.Linear(64, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = F.gelu(layer(x))
        return self.head(x)


def step(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


def batches(n, size=64):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(size, 64, generator=g), torch.randint(0, 5, (size,), generator=g)) for _ in range(n)]


def warmed():
    """A model whose optimizer holds its state already (so every step's peak is the same)."""
    torch.manual_seed(0)
    model = Wide()
    opt = torch.optim.Adam(model.parameters())
    with own_process():  # the test's fit starts its run at step 1
        gputui.fit(model, batches(1), step, opt)
    return model, opt


def tracked(model, opt, batch, micro_batch):
    return predict(model, opt, batch, step, micro_batch=micro_batch).tracked_peak


def test_recovery_picks_a_micro_batch_that_fits_in_one_retry_where_halving_takes_two():
    model, opt = warmed()
    data = batches(3)
    peaks = {m: tracked(model, opt, data[0], m) for m in (64, 32, 16)}
    # A budget where 32 (the first halving) does not fit and 16 (the second) does, with room between.
    budget = int((peaks[32] + peaks[16]) / 2 / planning.FIT_AT_TRACKED)
    assert peaks[32] > budget > peaks[16] / planning.FIT_AT_TRACKED
    ref, ref_opt = copy.deepcopy((model, opt))
    result = gputui.fit(model, data, step, opt, memory_budget=budget)
    recovered = [e for e in result.events if e.name == "oom_recovered"]
    assert len(recovered) == 1 and result.ooms_recovered == 1
    picked = recovered[0]["micro_batch_to"]
    assert 16 < picked < 32
    assert recovered[0]["reason"].startswith("predicted peak") and f"at {picked}:" in recovered[0]["reason"]
    # the largest: one more sample would not fit
    assert tracked(model, opt, data[0], picked + 1) > planning.FIT_AT_TRACKED * budget
    assert result.steps == 3 and result.micro_batch == picked
    for batch in data:  # the replay at the picked size trained what one plain step a batch trains
        step(ref, batch).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    assert_same_weights(model, ref)


def test_a_second_oom_in_a_step_halves_however_low_the_planner_predicts(monkeypatch):
    """Predictions low by a fifth (on a GPU under a tight cap: fragmentation and segment rounding the trace
    cannot see): each pick that runs out teaches a correction that moves the next pick by the planner's
    margin alone, and 16 OOMs on one batch ended the run. After the step's second OOM, recovery halves."""
    from gputui.plan import predictions

    model, opt = warmed()
    data = batches(2)
    peaks = {m: tracked(model, opt, data[0], m) for m in (16, 8)}
    budget = int((peaks[16] + peaks[8]) / 2 / planning.FIT_AT_TRACKED)
    honest = predictions.Predictions.peak
    monkeypatch.setattr(predictions.Predictions, "peak", lambda self, p: int(honest(self, p) * 0.8))
    asked: list[tuple[int, bool, list[int]]] = []  # each OOM's (failed micro-batch, second, sizes predicted)
    after_oom, get = planning.Planner.after_oom, predictions.Predictions.get

    inside = []

    def recording_after_oom(self, failed, *args):
        asked.append((failed.micro_batch, args[-1], []))
        inside.append(True)
        try:
            return after_oom(self, failed, *args)
        finally:
            inside.pop()

    def recording_get(self, setting, *args):
        if inside:
            asked[-1][2].append(setting.micro_batch)
        return get(self, setting, *args)

    monkeypatch.setattr(planning.Planner, "after_oom", recording_after_oom)
    monkeypatch.setattr(predictions.Predictions, "get", recording_get)
    result = gputui.fit(model, data, step, opt, memory_budget=budget)
    recovered = [e for e in result.events if e.name == "oom_recovered"]
    assert recovered[0]["reason"].startswith("predicted peak")  # the first OOM: the planner's pick
    for e in recovered[1:]:
        assert e["micro_batch_to"] == e["micro_batch"] // 2, e
        assert e["reason"].startswith("halved after a second OOM in this step ("), e
    assert result.steps == 2 and len(recovered) <= 4
    assert [second for _, second, _ in asked] == [False] + [True] * (len(asked) - 1)
    for failed, _, sizes in asked[1:]:  # no search above half: a pick there would not be taken
        assert not [m for m in sizes if failed // 2 < m < failed], (failed, sizes)


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_before_a_measured_step_the_correction_on_cuda_is_what_the_allocator_holds_beyond_the_state(
    monkeypatch, device
):
    """On the H200, micro_batch="auto" picked before any step, blind to the 64 MiB of cuBLAS workspaces and to
    what the script keeps (an EMA copy): on CUDA the correction starts as memory_allocated() less the training
    state on the device (none of this CPU model's); a CPU budget counts the state alone, and starts at 0."""
    from gputui.plan.predictions import Predictions

    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 123 << 20)
    model = Wide()
    predictions = Predictions(
        model,
        torch.optim.SGD(model.parameters()),
        step,
        torch.device(device),
        tracked=device == "cpu",
        fit_at=planning.FIT_AT,
        checkpoint_modules=None,
        blocks=0,
        floor=1,
        turned_off=lambda why: None,
    )
    assert predictions.correction == (123 << 20 if device == "cuda" else 0)


def test_recovery_halves_when_the_step_cannot_be_traced():
    """A shape that depends on the data (a boolean mask) cannot be made on fake tensors: recovery halves."""

    def masked(model, batch):
        x, y = batch
        keep = y >= 0  # every sample, but the trace cannot know how many
        return F.cross_entropy(model(x[keep]), y[keep])

    model, opt = warmed()
    data = batches(2)
    budget = int(tracked(model, opt, data[0], 40) / planning.FIT_AT_TRACKED)
    result = gputui.fit(model, data, masked, opt, memory_budget=budget)
    recovered = [e for e in result.events if e.name == "oom_recovered"]
    assert recovered and recovered[0]["micro_batch_to"] == 32 and recovered[0]["reason"] == "halved"
    assert result.steps == 2


def test_a_step_that_reads_its_loss_is_traced_and_marked_approximate():
    """Logging `loss.item()` in step() is common: the trace answers it with a stand-in, says so, and the
    pick still fits at once."""

    def logging(model, batch):
        loss = step(model, batch)
        print(f"loss {loss.item():.3f}")
        return loss

    model, opt = warmed()
    data = batches(3)
    budget = int(tracked(model, opt, data[0], 40) / planning.FIT_AT_TRACKED)
    result = gputui.fit(model, data, logging, opt, memory_budget=budget)
    recovered = [e for e in result.events if e.name == "oom_recovered"]
    assert len(recovered) == 1 and recovered[0]["reason"].startswith("estimated peak")
    assert 32 < recovered[0]["micro_batch_to"] <= 40 and result.steps == 3
    assert predict(model, opt, data[0], logging).reason.startswith("the step read 1 tensor value(s) (.item()")


def test_auto_micro_batch_starts_at_the_largest_that_fits():
    model, opt = warmed()
    data = batches(3)
    budget = int(tracked(model, opt, data[0], 24) / planning.FIT_AT_TRACKED) + 1
    result = gputui.fit(model, data, step, opt, memory_budget=budget, micro_batch="auto")
    changed = [e for e in result.events if e.name == "micro_batch_changed"]
    assert changed and changed[0]["from"] == 64 and changed[0]["reason"].startswith("auto: predicted peak")
    assert changed[0]["to"] == result.micro_batch == 24
    assert result.ooms_recovered == 0 and result.steps == 3


def test_auto_micro_batch_without_a_capacity_trains_the_whole_batch():
    model, opt = warmed()
    result = gputui.fit(model, batches(2), step, opt, micro_batch="auto")
    changed = [e for e in result.events if e.name == "micro_batch_changed"]
    assert changed[0]["to"] == 64 and "capacity is unknown" in changed[0]["reason"]
    assert result.micro_batch == 64


def test_the_plan_control_is_answered_with_every_remedy_and_the_measured_step_agrees(hub):
    model, opt = warmed()
    data = batches(4)
    budget = 64 * 2**20
    hub.add_sink(RequestAt(hub, 1, "plan"))
    result = gputui.fit(model, data, step, opt, memory_budget=budget, micro_batch=32)
    plans = [e for e in result.events if e.name == "plan"]
    assert len(plans) == 1
    plan = plans[0]
    assert plan["trigger"] == "asked" and plan["complete"] and plan["capacity"] == budget and plan["tracked"]
    rows = {(o["remedy"], o["amp"], o["checkpointing"], o["micro_batch"]): o for o in plan["options"]}
    assert set(rows) == {
        ("now", "off", False, 32),
        ("halve", "off", False, 16),
        ("double", "off", False, 64),
        ("amp", "bf16", False, 32),
        ("amp", "fp16", False, 32),
        ("checkpointing", "off", True, 32),
        ("best", "off", False, 64),  # the whole batch fits the budget
    }
    now = rows["now", "off", False, 32]
    assert now["exact"] and now["fits"] and now["accumulation"] == 2
    assert {o["batch_size"] for o in plan["options"]} == {64}  # the screen writes an uneven cut as its pieces
    assert rows["halve", "off", False, 16]["label"] == "micro-batch 16x4"
    assert all("key" not in o for o in plan["options"])  # a row is named by its remedy: the screen knows the keys
    # the prediction for the setting in use is what the next steps measured (the tracker's count)
    peaks = [s.memory.peak for s in hub.samples() if s.step > 1]
    assert peaks and all(p == now["predicted"] for p in peaks)
    assert result.steps == 4


def test_a_plan_is_made_ahead_when_the_step_peak_nears_capacity():
    model, opt = warmed()
    data = batches(3)
    budget = int(tracked(model, opt, data[0], 64) / 0.95)  # the peak at 95 %: past NEAR_CAPACITY, fits
    result = gputui.fit(model, data, step, opt, memory_budget=budget)
    plans = [e for e in result.events if e.name == "plan"]
    assert [p["trigger"] for p in plans] == ["near_capacity"]  # once per setting, not every step
    assert result.ooms_recovered == 0


def test_a_planner_that_fails_halves_and_training_goes_on(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("planner bug")

    monkeypatch.setattr(planning.Planner, "after_oom", broken)
    model, opt = warmed()
    data = batches(2)
    budget = int(tracked(model, opt, data[0], 40) / planning.FIT_AT_TRACKED)
    result = gputui.fit(model, data, step, opt, memory_budget=budget)
    assert [e["micro_batch_to"] for e in result.events if e.name == "oom_recovered"] == [32]
    errors = [e for e in result.events if e.name == "error"]
    assert errors and "planner bug" in errors[0]["message"]
    assert result.steps == 2


@pytest.mark.parametrize("micro_batch", [0, -1, "big", True])
def test_micro_batch_must_be_positive_or_auto(micro_batch):
    with pytest.raises(ValueError, match="micro_batch"):
        gputui.fit(
            ConvNet(), conv_batches(1, 4), conv_step, torch.optim.SGD(ConvNet().parameters()), micro_batch=micro_batch
        )


def test_a_remedy_after_a_plan_plans_again_for_the_new_setting(hub):
    model, opt = warmed()
    hub.add_sink(RequestAt(hub, 1, "plan"))
    hub.add_sink(RequestAt(hub, 2, "halve_batch"))
    result = gputui.fit(model, batches(5), step, opt, memory_budget=64 * 2**20, micro_batch=32)
    plans = [e for e in result.events if e.name == "plan"]
    assert [p["trigger"] for p in plans] == ["asked", "changed"]
    now = [next(o for o in p["options"] if o["remedy"] == "now") for p in plans]
    assert [o["micro_batch"] for o in now] == [32, 16]
    # the first table's measured peak is the step before it was asked for: its calibration line has a figure
    assert plans[0]["measured"] is not None and plans[0]["measured"] > 0


def test_a_setting_that_cannot_be_traced_leaves_the_others_exact(hub):
    def picky(model, batch):  # a shape from the data, only under autocast
        x, y = batch
        if torch.is_autocast_enabled("cpu"):
            keep = y >= 0
            x, y = x[keep], y[keep]
        return step(model, (x, y))

    model, opt = warmed()
    hub.add_sink(RequestAt(hub, 1, "plan"))
    result = gputui.fit(model, batches(3), picky, opt, memory_budget=64 * 2**20, micro_batch=32)
    plan = [e for e in result.events if e.name == "plan"][-1]
    assert plan["complete"]
    exact = {(o["remedy"], o["amp"]): o["exact"] for o in plan["options"]}
    assert exact["now", "off"] and exact["halve", "off"] and exact["checkpointing", "off"]
    assert not exact["amp", "bf16"] and not exact["amp", "fp16"]
    amp = next(o for o in plan["options"] if o["remedy"] == "amp")
    assert "depends on the data" in amp["reason"]


def test_an_estimate_from_a_reading_with_totals_only_keeps_the_training_state_fixed(hub, monkeypatch):
    """A CUDA reading has the allocator's totals, no breakdown: the parameters, gradients and optimizer
    state are counted from their storages, so an estimate (a step that cannot be traced) scales only the
    rest with the micro-batch, not the whole peak."""
    import dataclasses

    import gputui.engine.session as session

    real = session.for_device

    def totals_only(device, tracker, **kwargs):  # as CudaProbe reads: no params, grads, optimizer
        probe = real(device, tracker, **kwargs)
        read = probe.read
        probe.read = probe.step_reading = lambda *now: dataclasses.replace(
            read(), params=None, grads=None, optimizer=None, activations=None
        )
        return probe

    monkeypatch.setattr(session, "for_device", totals_only)

    def masked(model, batch):  # a shape from the data: no trace, estimates
        x, y = batch
        keep = y >= 0
        return step(model, (x[keep], y[keep]))

    monkeypatch.setattr(probes, "STEP_READ_S", 0.0)  # step 2's sample is its own reading, as the planner's
    model, opt = warmed()
    hub.add_sink(RequestAt(hub, 2, "plan"))
    result = gputui.fit(model, batches(4), masked, opt, memory_budget=64 * 2**20, micro_batch=32)
    plan = [e for e in result.events if e.name == "plan"][-1]
    rows = {o["remedy"]: o for o in plan["options"]}
    params = tensor_bytes(model.parameters())
    state = tensor_bytes(state_tensors(opt))
    now, halve = rows["now"], rows["halve"]
    assert not now["exact"] and not halve["exact"]
    for row in (now, halve):
        fixed = {k: row["breakdown"][k] for k in ("parameters", "gradients", "optimizer")}
        assert fixed == {"parameters": params, "gradients": params, "optimizer": state}
    # what moves with the micro-batch is what the measured peak held beyond the state
    measured = [s.memory.peak for s in hub.samples() if s.step == 2][0]
    assert now["breakdown"]["activations"] == measured - 2 * params - state
    assert halve["breakdown"]["activations"] == now["breakdown"]["activations"] // 2


def test_a_boundary_starts_no_trace_that_would_end_past_its_share(monkeypatch):
    """Traces of 0.3 s and a boundary's 0.5 s: the first is made, the second would end at 0.6 s and waits
    for the next boundary (it began before 0.5 s and held the step until 0.6 s); the next boundary makes it."""
    from gputui.plan import trace
    from gputui.plan.predictions import Later, Predictions
    from gputui.plan.table import Setting

    made = []
    monkeypatch.setattr(trace, "predict", lambda *a, micro_batch, **k: made.append(micro_batch) or time.sleep(0.3) or 1)
    model = nn.Linear(4, 2)
    predictions = Predictions(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        step,
        torch.device("cpu"),
        tracked=True,
        fit_at=0.9,
        checkpoint_modules=None,
        blocks=0,
        floor=1,
        turned_off=lambda why: None,
    )
    batch = (torch.randn(8, 4), torch.randint(2, (8,)))
    predictions.deadline = time.monotonic() + 0.5
    predictions.get(Setting(8, "off", False), batch, "shapes")
    with pytest.raises(Later):
        predictions.get(Setting(4, "off", False), batch, "shapes")
    predictions.deadline = time.monotonic() + 0.5  # the next boundary's share
    predictions.get(Setting(4, "off", False), batch, "shapes")
    assert made == [8, 4]
