"""Controls reach the loop only at a step boundary, and each one is answered by an event."""

import random
import threading

import torch
from helpers import ConvNet, RequestAt, conv_batches, conv_step, on_event, own_process

import gputui
from gputui.telemetry import hub as hubs


class Recorder:
    """A step() that notes, per optimizer step, the micro-batch size and autocast dtype it ran under."""

    def __init__(self, optimizer_steps):
        self.optimizer_steps = optimizer_steps
        self.calls = []

    def __call__(self, model, batch):
        autocast = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None
        self.calls.append((self.optimizer_steps[0], len(batch[0]), autocast))
        return conv_step(model, batch)


def counting_sgd(model):
    count = [0]

    class Counting(torch.optim.SGD):
        def step(self, closure=None):
            count[0] += 1
            return super().step(closure)

    return Counting(model.parameters(), lr=0.01), count


def test_controls_never_apply_inside_an_accumulation_window(hub):
    model = ConvNet()
    opt, count = counting_sgd(model)
    step = Recorder(count)
    done = threading.Event()
    rnd = random.Random(0)
    actions = [
        ("halve_batch", None),
        ("double_batch", None),
        ("set_amp", "bf16"),
        ("set_amp", "off"),
        ("set_checkpointing", True),
        ("set_checkpointing", False),
    ]

    def storm():
        while not done.is_set():
            hub.controls.request(*rnd.choice(actions), source="storm")
            done.wait(0.002)

    t = threading.Thread(target=storm)
    t.start()
    try:
        result = gputui.fit(model, conv_batches(40, 16), step, opt, micro_batch=4)
    finally:
        done.set()
        t.join()
    assert result.steps == 40
    per_step = {}
    for index, _size, dtype in step.calls:
        per_step.setdefault(index, set()).add(dtype)
    assert all(len(dtypes) == 1 for dtypes in per_step.values()), "autocast changed inside a step"
    for index in per_step:
        sizes = [s for i, s, _ in step.calls if i == index]
        assert sum(sizes) == 16 and len(set(sizes[:-1])) <= 1, f"micro-batch changed inside step {index}: {sizes}"
    applied = {e.name for e in result.events}
    assert {"micro_batch_changed", "amp_changed", "checkpointing_changed"} <= applied


def test_each_control_applied_at_the_next_boundary_with_an_event(hub):
    model = ConvNet()
    hub.add_sink(RequestAt(hub, 6, "stop"))
    for action, value in [
        ("halve_batch", None),
        ("halve_batch", None),
        ("set_amp", "bf16"),
        ("set_checkpointing", True),
        ("set_auto_recover", False),
        ("free_cache", None),
        ("free_cache", None),
        ("double_batch", None),
    ]:
        hub.controls.request(action, value, source="test")
    result = gputui.fit(model, conv_batches(10, 8), conv_step, torch.optim.SGD(model.parameters(), lr=0.01))
    assert result.stopped == "requested" and result.steps == 6
    events = result.events
    assert [e.name for e in events] == [
        "micro_batch_changed",
        "micro_batch_changed",
        "amp_changed",
        "checkpointing_changed",
        "auto_recover_changed",
        "cache_freed",
        "control_refused",
        "micro_batch_changed",
        "stopped",
    ]
    assert all(e.step == 0 for e in events[:-1]) and events[-1].step == 6
    assert [(e["from"], e["to"], e["accumulation"]) for e in events if e.name == "micro_batch_changed"] == [
        (8, 4, 2),
        (4, 2, 4),
        (2, 4, 2),
    ]
    assert events[2]["to"] == "bf16" and events[3]["enabled"] is True and events[3]["how"] == "3 x Residual"
    assert events[5]["rss_before"] > 0 and "bytes" in events[5].details
    assert events[6]["reason"] == "the cache was freed at this boundary already"
    assert all(e["source"] == "test" and e["latency_s"] >= 0 for e in events[:-1])
    assert result.amp == "bf16" and result.checkpointing and result.micro_batch == 4
    assert not any("forward" in vars(m) for m in model.modules())


def test_refused_controls_say_why(hub):
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(108, 5))  # no repeated blocks
    for action, value in [
        ("double_batch", None),
        ("set_amp", "off"),
        ("set_checkpointing", True),
        ("resume", None),
        ("set_auto_recover", True),
    ]:
        hub.controls.request(action, value)
    hub.add_sink(RequestAt(hub, 1, "stop"))
    result = gputui.fit(model, conv_batches(3, 1), conv_step, torch.optim.SGD(model.parameters(), lr=0.01))
    reasons = [e["reason"] for e in result.events if e.name == "control_refused"]
    assert reasons == [
        "the micro-batch already equals the global batch (1)",
        "AMP is already off",
        "no repeated blocks found (no ModuleList/Sequential of same-type layers): "
        "pass checkpoint_modules=[...] to fit()",
        "not paused",
        "auto-recover is already on",
    ]
    with own_process():  # in this one the stop above holds: every later fit would return at once
        hubs.current().controls.request("halve_batch")
        result = gputui.fit(model, conv_batches(1, 1), conv_step, torch.optim.SGD(model.parameters(), lr=0.01))
    assert result.events[0]["reason"] == "the micro-batch is already 1"


def test_pause_holds_training_until_resume(hub):
    model = ConvNet()
    hub.controls.request("pause")
    seen = []
    resumer = on_event(hub, "paused", lambda: (seen.append(len(hub.samples())), hub.controls.request("resume")))
    result = gputui.fit(model, conv_batches(3, 4), conv_step, torch.optim.SGD(model.parameters(), lr=0.01))
    resumer.join(5)
    assert seen == [0], "no step may run while paused"
    assert [e.name for e in result.events] == ["paused", "resumed"] and result.steps == 3


def test_stop_while_paused(hub):
    model = ConvNet()
    hub.controls.request("pause")
    on_event(hub, "paused", lambda: hub.controls.request("stop"))
    result = gputui.fit(model, conv_batches(3, 4), conv_step, torch.optim.SGD(model.parameters(), lr=0.01))
    assert result.stopped == "requested" and result.steps == 0


def test_a_change_asked_after_a_stop_is_refused_and_the_summary_says_what_trained(hub):
    """`q y b` within a step: the stop and the halving reach the same boundary. No step would train at the
    halved micro-batch, so it is refused, and the run's end reports the micro-batch its steps used."""
    model = ConvNet()

    class Asked(RequestAt):
        def on_sample(self, sample):
            super().on_sample(sample)
            if self.seen == self.n:
                for action, value in [
                    ("halve_batch", None),
                    ("set_amp", "bf16"),
                    ("pause", None),
                    ("free_cache", None),
                ]:
                    self.hub.controls.request(action, value)

    hub.add_sink(Asked(hub, 2, "stop"))
    result = gputui.fit(model, conv_batches(5, 8), conv_step, torch.optim.SGD(model.parameters(), lr=0.01))
    refused = [(e["action"], e["reason"]) for e in result.events if e.name == "control_refused"]
    assert refused == [(a, "the run is stopping after this step") for a in ("halve_batch", "set_amp", "pause")]
    assert [e.name for e in result.events if e.name != "control_refused"] == ["cache_freed", "stopped"]
    assert result.stopped == "requested" and result.steps == 2 and result.micro_batch == 8 and result.amp == "off"
