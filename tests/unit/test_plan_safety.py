"""The planner never crashes the run, changes its result, keeps its copies or leaves a request unanswered.

A trace runs the script's own step() on fake tensors: whatever the step caches outside the model (an
lru_cache, a module-level dict) would hold a fake tensor that the next real step dies on; whatever it
draws or counts would move the real run. These tests train through fit with the planner at work and
compare with what the script would have done without it.
"""

import copy
import functools
import gc
import random
import weakref

import numpy as np
import pytest
import torch
from helpers import RequestAt, Sink, assert_same_weights
from test_planning import Wide, batches, step, tracked, warmed
from torch import nn
from torch.nn import functional as F

import gputui
from gputui import plan
from gputui.plan import planner as planning
from gputui.plan import trace


def fake(t) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def plain_training(model, opt, data, step_fn):
    for batch in data:
        step_fn(model, batch).backward()
        opt.step()
        opt.zero_grad()


# -- crashes: a trace's fake tensors left in the script's own caches ------------------------------------


@functools.lru_cache
def column_scale(n: int) -> torch.Tensor:
    """A per-batch-size constant, cached as scripts do."""
    return torch.full((n, 1), 0.5)


def scaled(model, batch):
    x, y = batch
    return F.cross_entropy(model(x * column_scale(x.shape[0])), y)


def test_a_constant_cached_per_batch_size_survives_the_oom_pick_and_the_real_step_at_that_size():
    model, opt = warmed()
    data = batches(3)
    peaks = {m: tracked(model, opt, data[0], m) for m in (32, 16)}
    budget = int((peaks[32] + peaks[16]) / 2 / planning.FIT_AT_TRACKED)
    column_scale.cache_clear()
    ref, ref_opt = copy.deepcopy((model, opt))
    result = gputui.fit(model, data, scaled, opt, memory_budget=budget)
    recovered = [e for e in result.events if e.name == "oom_recovered"]
    assert len(recovered) == 1 and recovered[0]["reason"].startswith("predicted peak")  # picked by traces
    assert 16 < recovered[0]["micro_batch_to"] < 32 and result.steps == 3
    plain_training(ref, ref_opt, data, scaled)
    assert_same_weights(model, ref)


MASKS: dict[int, torch.Tensor] = {}
"""Causal masks by sequence length, made on first use: a module-level cache."""


class Causal(nn.Module):
    """Each position averages the ones before it (a causal mask, cached by length)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj, self.head = nn.Linear(16, 64), nn.Linear(64, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        length = x.shape[1]
        if length not in MASKS:
            MASKS[length] = torch.ones(length, length).tril() / torch.arange(1, length + 1).unsqueeze(1)
        return self.head(torch.tanh(MASKS[length] @ self.proj(x))).mean(1)


def sequences(n, size=32, length=12):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(size, length, 16, generator=g), torch.randint(0, 5, (size,), generator=g)) for _ in range(n)]


def test_a_mask_cached_by_sequence_length_survives_the_auto_micro_batch_at_the_first_step():
    torch.manual_seed(0)
    model = Causal()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = sequences(3)
    budget = int(plan.predict(model, opt, data[0], step, micro_batch=12).tracked_peak / planning.FIT_AT_TRACKED) + 1
    MASKS.clear()
    result = gputui.fit(model, data, step, opt, memory_budget=budget, micro_batch="auto")
    changed = next(e for e in result.events if e.name == "micro_batch_changed")
    assert changed["reason"].startswith("auto: predicted peak") and changed["to"] < 32
    assert result.steps == 3 and MASKS and not any(fake(m) for m in MASKS.values())


def test_a_plan_asked_before_the_first_step_leaves_the_cache_to_the_real_step(hub):
    column_scale.cache_clear()
    model, opt = warmed()
    hub.controls.request("plan")  # `gputui ctl JOB plan` while the script was still starting
    result = gputui.fit(model, batches(3), scaled, opt, memory_budget=64 * 2**20)
    answered = [e for e in result.events if e.name == "plan" and e.get("request_id") is not None]
    assert len(answered) == 1 and answered[0]["complete"] and result.steps == 3


def test_a_fake_left_where_it_cannot_be_taken_back_turns_the_planner_off_and_says_where(hub):
    """A list item in the middle of a list (its previous value unknown): the planner stops tracing for the
    run and says where; OOM recovery halves from then on."""
    kept: list[object] = ["first"]

    def keeping(model, batch):
        loss = step(model, batch)
        kept.insert(0, loss.detach())  # the newest first: a fake in the middle, once a real step adds one
        return loss

    model, opt = warmed()
    data = batches(2)
    budget = int(tracked(model, opt, data[0], 40) / planning.FIT_AT_TRACKED)
    kept[:] = ["first"]
    result = gputui.fit(model, data, keeping, opt, memory_budget=budget)
    errors = [e["message"] for e in result.events if e.name == "error"]
    assert len(errors) == 1 and "planning is off for this run" in errors[0] and "an item of a list" in errors[0]
    assert [e["reason"] for e in result.events if e.name == "oom_recovered"][-1] == "halved"


# -- the copies: nothing of a trace outlives it -----------------------------------------------------


class Marker:
    """Held by the model: each copy a trace makes is remembered weakly."""

    copies: list[weakref.ref] = []

    def __deepcopy__(self, memo):
        made = Marker()
        Marker.copies.append(weakref.ref(made))
        return made


@pytest.mark.parametrize(
    "settings", [{}, {"checkpointing": True, "amp": "bf16", "micro_batch": 16}], ids=["as is", "every remedy"]
)
def test_nothing_of_a_traces_copy_outlives_the_prediction(settings):
    model, opt = warmed()
    model.marker = Marker()
    Marker.copies.clear()
    plan.predict(model, opt, batches(1)[0], step, **settings)
    gc.collect()
    assert len(Marker.copies) == 1 and Marker.copies[0]() is None


def test_nothing_of_the_planners_copies_outlives_fit(hub):
    model, opt = warmed()
    model.marker = Marker()
    Marker.copies.clear()
    hub.add_sink(RequestAt(hub, 1, "plan"))
    gputui.fit(model, batches(3), step, opt, memory_budget=64 * 2**20, micro_batch=32)
    gc.collect()
    assert Marker.copies and not [c for c in Marker.copies if c() is not None]


# -- side effects: what a trace runs is put back ------------------------------------------------------

NOISE = np.random.default_rng(0)
COIN = random.Random(0)
CALLS = 0


def noisy(model, batch):
    """An augmentation from the script's own generators, and a global counter."""
    global CALLS
    CALLS += 1
    x, y = batch
    jitter = torch.from_numpy(NOISE.standard_normal(tuple(x.shape), dtype=np.float32))
    return step(model, (x * (1 + 0.1 * COIN.random()) + 0.01 * jitter, y))


def test_a_plan_moves_neither_the_steps_own_generators_nor_its_counters_nor_the_weights(hub):
    global NOISE, COIN, CALLS
    base, base_opt = warmed()
    finals = []
    for planned in (False, True):
        model, opt = copy.deepcopy((base, base_opt))
        NOISE, COIN, CALLS = np.random.default_rng(0), random.Random(0), 0
        if planned:
            hub.add_sink(RequestAt(hub, 1, "plan"))
        result = gputui.fit(model, batches(4), noisy, opt, memory_budget=64 * 2**20, micro_batch=32)
        assert [e["complete"] for e in result.events if e.name == "plan"] == ([True] if planned else [])
        finals.append((model, CALLS, NOISE.random(), COIN.random()))
    (plain, calls, noise, coin), (model, planned_calls, planned_noise, planned_coin) = finals
    assert planned_calls == calls == 8  # two micro-batches a step: the trace's calls were taken back
    assert (planned_noise, planned_coin) == (noise, coin)
    assert_same_weights(model, plain, atol=0, rtol=0)


# -- planning="auto" | "asked" | "off" ------------------------------------------------------------------


def counted(monkeypatch) -> list[int]:
    traces: list[int] = []
    real = trace.predict

    def predict(*args, **kwargs):
        traces.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(trace, "predict", predict)  # where the planner calls it
    return traces


def test_planning_asked_traces_only_what_is_asked_for(hub, monkeypatch):
    traces = counted(monkeypatch)
    model, opt = warmed()
    data = batches(3)
    budget = int(tracked(model, opt, data[0], 40) / planning.FIT_AT_TRACKED)
    result = gputui.fit(model, data, step, opt, memory_budget=budget, planning="asked")
    assert [e["reason"] for e in result.events if e.name == "oom_recovered"] == ["halved"]
    assert not traces and not [e for e in result.events if e.name == "plan"]  # no table made by itself
    hub.add_sink(RequestAt(hub, 1, "plan"))
    result = gputui.fit(model, data, step, opt, memory_budget=budget, planning="asked")
    assert [e["trigger"] for e in result.events if e.name == "plan"] == ["asked"] and traces


def test_planning_off_never_traces_and_refuses_a_plan_with_the_reason(hub, monkeypatch):
    traces = counted(monkeypatch)
    model, opt = warmed()
    data = batches(3)
    budget = int(tracked(model, opt, data[0], 40) / planning.FIT_AT_TRACKED)
    hub.add_sink(RequestAt(hub, 1, "plan"))
    result = gputui.fit(model, data, step, opt, memory_budget=budget, planning="off")
    refused = [e for e in result.events if e.name == "control_refused"]
    assert len(refused) == 1 and refused[0]["action"] == "plan" and 'planning="off"' in refused[0]["reason"]
    assert hub.info.refused["plan"] == refused[0]["reason"]  # the screen dims w with it
    assert [e["reason"] for e in result.events if e.name == "oom_recovered"] == ["halved"] and not traces


@pytest.mark.parametrize(
    "options, message",
    [
        ({"planning": "never"}, 'planning must be "auto", "asked" or "off"'),
        ({"planning": "off", "micro_batch": "auto"}, 'micro_batch="auto" needs the planner'),
    ],
)
def test_bad_planning_is_one_clear_error(options, message):
    model = Wide()
    with pytest.raises(ValueError, match=message):
        gputui.fit(model, batches(1), step, torch.optim.SGD(model.parameters()), **options)


# -- hangs: every request is answered, or refused with the reason ---------------------------------------


class Then(Sink):
    """Requests `then` (action, value) once an event named `when` is emitted (and `check` says so)."""

    def __init__(self, hub, when, then, check=lambda e: True):
        self.hub, self.when, self.then, self.check, self.done = hub, when, then, check, False

    def on_event(self, event):
        if event.name == self.when and self.check(event) and not self.done:
            self.done = True
            self.hub.controls.request(*self.then)


def answers(events, requests) -> dict[int, str]:
    ids = {r.id for r in requests}
    return {e["request_id"]: e.name for e in events if e.get("request_id") in ids}


def test_four_plans_asked_at_once_are_each_answered(hub):
    model, opt = warmed()
    requests = []

    class Four(Sink):
        def on_sample(self, sample):
            if sample.step == 1:
                requests.extend(hub.controls.request("plan", source=f"ctl {i}") for i in range(4))

    hub.add_sink(Four())
    result = gputui.fit(model, batches(3), step, opt, memory_budget=64 * 2**20, micro_batch=32)
    assert answers(result.events, requests) == {r.id: "plan" for r in requests}


@pytest.mark.timeout(60)  # before the fix, the pause waited for an answer that never came
def test_a_plan_asked_while_paused_at_an_oom_is_answered_there_and_the_dialog_gets_its_own(hub):
    model, opt = warmed()
    data = batches(2)
    budget = int(tracked(model, opt, data[0], 40) / planning.FIT_AT_TRACKED)
    asked = []

    class AskAfterTheDialogsTable(Sink):  # w pressed while the dialog shows the planner's own table
        def on_event(self, event):
            if event.name == "plan" and event["trigger"] == "oom" and not asked:
                asked.append(hub.controls.request("plan"))

    hub.add_sink(AskAfterTheDialogsTable())
    hub.add_sink(Then(hub, "plan", ("halve_batch",), lambda e: e.get("request_id") is not None))
    result = gputui.fit(model, data, step, opt, memory_budget=budget, auto_recover=False)
    names = [e.name for e in result.events]
    oom, resumed = names.index("oom"), names.index("resumed")
    plans = [e for e in result.events[oom:resumed] if e.name == "plan"]
    assert [p["trigger"] for p in plans] == ["oom", "asked"] and all(p["complete"] for p in plans)
    assert plans[1]["request_id"] == asked[0].id
    now = next(o for o in plans[0]["options"] if o["remedy"] == "now")
    assert now["micro_batch"] == 64 and now["fits"] is False  # the OOM taught it: as is does not fit
    assert result.events[oom]["planning"] is True and result.steps == 2


@pytest.mark.timeout(60)
def test_a_plan_asked_while_paused_is_answered_before_the_resume(hub):
    model, opt = warmed()
    requests = []

    class PauseAndAsk(Sink):
        def on_sample(self, sample):
            if sample.step == 1:
                requests.extend([hub.controls.request("pause"), hub.controls.request("plan")])

    hub.add_sink(PauseAndAsk())
    hub.add_sink(Then(hub, "plan", ("resume",)))
    result = gputui.fit(model, batches(3), step, opt, memory_budget=64 * 2**20, micro_batch=32)
    names = [e.name for e in result.events]
    assert names.index("paused") < names.index("plan") < names.index("resumed") and result.steps == 3


def test_a_plan_the_run_cannot_finish_is_refused_when_it_ends(hub, monkeypatch):
    monkeypatch.setattr(planning, "ASKED_S", 0.0)  # every boundary is out of tracing time at once
    model, opt = warmed()
    requests = []

    class Ask(Sink):
        def on_sample(self, sample):
            if sample.step == 1:
                requests.append(hub.controls.request("plan"))

    hub.add_sink(Ask())
    gputui.fit(model, batches(2), step, opt, memory_budget=64 * 2**20, micro_batch=32)
    assert answers(hub.events(), requests) == {requests[0].id: "control_refused"}
    refused = next(e for e in hub.events() if e.get("request_id") == requests[0].id)
    assert refused["reason"] == "the run ended before the plan was complete"


CRASHED_WITH_GC_OFF = """
import gc, torch, gputui
from gputui.plan import planner
from torch.nn import functional as F

planner.OOM_S = 60.0  # the pick traced to its end, however loaded the machine (as tests/unit/conftest.py)

class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear, self.drop = torch.nn.Linear(8, 8), torch.nn.Dropout(0.1)

    def forward(self, x):
        return x + self.drop(torch.tanh(self.linear(x)))

def train():
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Sequential(Block(), Block()), torch.nn.Linear(8, 1))
    batches = [(torch.randn(64, 4), torch.randn(64, 1))] * 3
    gc.disable()
    result = gputui.fit(model, batches, lambda m, b: F.mse_loss(m(b[0]), b[1]), torch.optim.Adam(model.parameters()),
                        memory_budget="6KiB")
    gc.enable()  # as a script that turns it off around training does
    return result.ooms_recovered

print("recovered", train())  # the batches are freed as train() returns
print("after")
"""


@pytest.mark.process
def test_a_script_with_the_collector_off_survives_the_planners_traces(tmp_path):
    """With the collector off during fit and on again after, the trace's fake mode (cyclic garbage) kept
    weak references on the batch's storages, and freeing the batch crashed the process (SIGSEGV in
    PyObject_ClearWeakRefs, every run)."""
    from process import python

    script = tmp_path / "gc_off.py"
    script.write_text(CRASHED_WITH_GC_OFF)
    done = python(script)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    lines = done.stdout.splitlines()
    assert "recovered 1" in lines and "after" in lines  # it trained through an OOM, and lived past the batch
