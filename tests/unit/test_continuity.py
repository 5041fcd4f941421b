"""One run per process: a script's fit calls and Trainers are one run on the process's hub. The steps
count on, a stop asked for holds, what the keys or an OOM changed is carried, the planner's predictions
are kept, and the run ends once, when the script does (hub.finish)."""

import json
import time

import torch
from helpers import ConvNet, RequestAt, Sink, conv_batches, conv_step, on_event
from test_oom import FailOn
from test_plan_safety import counted
from test_planning import Wide, batches, step

import gputui


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.05)


class Records(Sink):
    """Every start and end record the hub gives its sinks."""

    def __init__(self):
        self.starts, self.ends = [], []

    def on_start(self, info):
        self.starts.append(info)

    def on_end(self, summary):
        self.ends.append(summary)


def fit(model, n, size=8, **options):
    return gputui.fit(model, conv_batches(n, size), conv_step, sgd(model), **options)


def named(events, name):
    return [e for e in events if e.name == name]


def test_two_fit_calls_are_one_run_counting_on(hub):
    records = Records()
    hub.add_sink(records)
    model = ConvNet()
    first = fit(model, 3)
    hub.add_sink(RequestAt(hub, 1, "halve_batch"))  # at the second call's first step, run step 4
    second = fit(model, 2)
    assert [s.step for s in hub.samples()] == [1, 2, 3, 4, 5]
    assert hub.runs == 1 and len(records.starts) == 1 and records.starts[0].total_steps == 3
    (continued,) = named(hub.events(), "run_continued")
    assert continued["total_steps"] == 5 and continued.step == 3
    assert [e.step for e in named(second.events, "micro_batch_changed")] == [4]
    assert [(e.step, e["steps"]) for e in named(hub.events(), "part_ended")] == [(3, 3), (5, 2)]
    assert (first.steps, first.samples, second.steps, second.samples) == (3, 24, 2, 16)
    assert hub.summary is None and not records.ends  # the script goes on: no end yet
    hub.finish()
    (summary,) = records.ends
    assert summary is hub.summary and (summary.steps, summary.samples) == (5, 40) and summary.error is None
    hub.finish()  # once
    assert len(records.ends) == 1


def test_a_stop_between_calls_holds_for_every_later_call(hub):
    model = ConvNet()
    fit(model, 2)
    hub.controls.request("stop")  # q while the script works between two calls
    weights = [p.detach().clone() for p in model.parameters()]
    second, third = fit(model, 3), fit(model, 3)
    for result in (second, third):
        assert result.stopped == "requested" and result.steps == 0 and result.loss is None
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights, strict=True))
    assert [s.step for s in hub.samples()] == [1, 2]
    assert len(named(hub.events(), "stopped")) == 1
    hub.finish()
    assert hub.summary.stopped == "requested" and hub.summary.steps == 2


def test_auto_recover_set_off_by_a_key_stays_off_in_the_next_call(hub):
    model = ConvNet()
    hub.add_sink(RequestAt(hub, 1, "set_auto_recover", False))
    fit(model, 2)
    halve = on_event(hub, "oom", lambda: hub.controls.request("halve_batch"))  # the person, at the pause
    second = gputui.fit(model, conv_batches(2, 8), FailOn({1}), sgd(model), planning="asked")  # auto_recover=True
    halve.join(5)
    (continued,) = named(hub.events(), "run_continued")
    assert continued["auto_recover"] is False
    (oom,) = named(second.events, "oom")
    assert oom["waiting"] is True and "paused" in [e.name for e in second.events]
    assert not named(second.events, "oom_recovered") and second.steps == 2


def test_auto_recover_off_only_as_an_argument_is_not_carried(hub):
    model = ConvNet()
    fit(model, 2, auto_recover=False)
    on_event(hub, "paused", lambda: hub.controls.request("resume"))  # were it carried: no wait for a person
    second = gputui.fit(model, conv_batches(2, 8), FailOn({1}), sgd(model), planning="asked")
    (continued,) = named(hub.events(), "run_continued")
    assert continued["auto_recover"] is True
    assert len(named(second.events, "oom_recovered")) == 1 and not named(second.events, "paused")


def test_a_micro_batch_the_key_halved_is_where_the_next_call_on_that_model_starts(hub):
    model, other = ConvNet(), ConvNet()
    hub.add_sink(RequestAt(hub, 1, "halve_batch"))
    first = fit(model, 3, micro_batch=8)
    assert first.micro_batch == 4
    fit(model, 2, micro_batch=8)
    assert [s.micro_batch for s in hub.samples()] == [8, 4, 4, 4, 4]
    assert named(hub.events(), "run_continued")[0]["micro_batch"] == 4
    fit(other, 2, micro_batch=8)  # another model: its own argument
    assert [s.micro_batch for s in hub.samples()][5:] == [8, 8]


def test_an_argument_the_script_changed_since_its_last_call_holds_over_what_that_run_changed(hub):
    """The key halved 8 to 4; the next call asks for 2 (the script's choice), the one after asks for 2 again
    and takes up what was changed since (the key doubled it to 4 at the second call's first step), and AMP,
    passed as before, keeps what the key chose."""
    model = ConvNet()
    hub.add_sink(RequestAt(hub, 1, "halve_batch"))
    hub.add_sink(RequestAt(hub, 1, "set_amp", "bf16"))
    fit(model, 2, micro_batch=8)
    hub.add_sink(RequestAt(hub, 1, "double_batch"))
    second = fit(model, 2, micro_batch=2)
    third = fit(model, 1, micro_batch=2)
    assert [s.micro_batch for s in hub.samples()] == [8, 4, 2, 4, 4]
    assert [s.amp for s in hub.samples()] == ["off", "bf16", "bf16", "bf16", "bf16"]
    assert second.micro_batch == 4 and third.micro_batch == 4


def test_auto_and_the_whole_batch_are_different_arguments_though_auto_may_choose_the_whole_batch(hub):
    """micro_batch="auto" on a CPU with no budget chooses the whole batch, as None is: still, a call that asks
    for the other one than its last is the script's choice (the key's halving is not carried into it)."""
    for first, then in ((None, "auto"), ("auto", None)):
        model = ConvNet()
        hub.add_sink(RequestAt(hub, 1, "halve_batch"))
        fit(model, 2, micro_batch=first)
        fit(model, 2, micro_batch=then)
        assert [s.micro_batch for s in hub.samples()][-4:] == [8, 4, 8, 8], (first, then)


def test_the_planners_predictions_are_carried_to_the_next_call_on_that_model(hub, monkeypatch):
    traces = counted(monkeypatch)
    torch.manual_seed(0)
    model = Wide()
    opt = torch.optim.Adam(model.parameters())
    options = {"memory_budget": 64 * 2**20, "micro_batch": 32}
    hub.add_sink(RequestAt(hub, 1, "plan"))
    first = gputui.fit(model, batches(3), step, opt, **options)
    assert [e["complete"] for e in named(first.events, "plan")] == [True] and traces
    traced = len(traces)
    hub.add_sink(RequestAt(hub, 1, "plan"))
    second = gputui.fit(model, batches(3), step, opt, **options)
    assert [e["complete"] for e in named(second.events, "plan")] == [True]
    assert len(traces) == traced, "the second call traced again what the first had predicted"


def test_a_trainer_after_a_fit_continues_the_run(hub):
    model = ConvNet()
    fit(model, 3)
    with gputui.Trainer(model, sgd(model), conv_step) as trainer:
        results = [trainer.step(b) for b in conv_batches(2, 8, seed=1)]
    assert [r.steps for r in results] == [4, 5]
    assert [s.step for s in hub.samples()] == [1, 2, 3, 4, 5] and hub.runs == 1
    assert trainer.result().steps == 2
    (continued,) = named(hub.events(), "run_continued")
    assert named(hub.events(), "part_ended")[-1]["by"] == "Trainer" and continued.step == 3


def test_a_second_calls_metrics_file_starts_with_the_run_and_ends_with_the_call(hub, tmp_path):
    model = ConvNet()
    fit(model, 3)
    path = tmp_path / "m.jsonl"
    fit(model, 2, metrics=path)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines[0]["kind"] == "start" and lines[0]["mode"] == "fit" and lines[0]["total_steps"] == 3
    assert [x["step"] for x in lines if x["kind"] == "step"] == [4, 5]
    assert [x["name"] for x in lines if x["kind"] == "event"][0] == "run_continued"
    assert lines[-1]["kind"] == "end" and lines[-1]["steps"] == 2 and lines[-1]["samples"] == 16
    assert [x["kind"] for x in lines].count("start") == 1 and [x["kind"] for x in lines].count("end") == 1


def test_the_hub_is_idle_outside_a_step_and_not_inside_one(hub):
    seen = []

    def watched(model, batch):
        seen.append(hub.idle_since)
        return conv_step(model, batch)

    model = ConvNet()
    with gputui.Trainer(model, sgd(model), watched) as trainer:
        assert hub.idle_since is None  # not started: no step left yet
        trainer.step(conv_batches(1, 8)[0])
        after_step = hub.idle_since
        assert after_step is not None and after_step <= time.time()
        trainer.step(conv_batches(1, 8)[0])
    assert seen == [None, None]
    assert hub.idle_since is not None and hub.idle_since >= after_step


def test_time_outside_the_steps_is_not_in_the_rate(hub):
    """An evaluation between two steps of a Trainer (here a minute, as the hub says) is not training time:
    the samples/s starts over with the next step instead of averaging the gap in (the ETA would jump)."""
    model = ConvNet()
    batches = conv_batches(6, 4)
    with gputui.Trainer(model, sgd(model), conv_step) as trainer:
        for batch in batches[:3]:
            trainer.step(batch)
        assert hub.latest().samples_per_s is not None
        hub.idle_since = time.time() - 60
        for batch in batches[3:]:
            trainer.step(batch)
    rates = [s.samples_per_s for s in hub.samples()[3:]]
    assert rates[0] is None and rates[-1] is not None
