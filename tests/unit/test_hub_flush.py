"""A step is published as a row the hub flushes to its sinks in batches (telemetry/hub.py): a reader sees
every step at once, the sinks get them at a flush, before any event after them; a sink that takes
samples gets each step as it ends; and steps left waiting reach an attached client while the script
works outside a step, over a real socket."""

import dataclasses
import io
import os
import threading
import time

import pytest
import torch
from helpers import ConvNet, Sink, conv_batches, conv_step
from test_server import sample, until

import gputui
from gputui.telemetry.client import Mirror
from gputui.telemetry.hub import Hub, SinkFailed
from gputui.telemetry.progress import ProgressLine
from gputui.telemetry.run import RunInfo
from gputui.telemetry.sample import STEP_ROW, Event, StepRecord
from gputui.telemetry.server import TelemetryServer


class Seen(Sink):
    """Notes what it is given, in order: ("step", n) or (event name, its step)."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.seen: list[tuple[str, int]] = []
        self.fail_at = fail_at

    def on_record(self, record):
        if record.step == self.fail_at:
            raise SinkFailed("cannot write")
        self.seen.append(("step", record.step))

    def on_event(self, event):
        self.seen.append((event.name, event.step))


def row(step: int) -> list:
    """What RunSession.publish appends: StepSample's fields in order."""
    return list(STEP_ROW.values(sample(step)))


def timed(step: int, t: float, samples: int) -> list:
    """A row as published: its time and counters, its rates left for the hub."""
    return list(STEP_ROW.values(dataclasses.replace(sample(step), t=t, samples=samples)))


def test_the_hub_derives_each_rows_rates_and_a_clear_falls_between_the_rows_it_separates():
    """Rates are filled in as the rows are drained, over the steps since the last clear: steps published
    before a pause and drained after it are not rated across it."""
    hub = Hub()
    hub.rows.extend([timed(1, 10.0, 8), timed(2, 10.5, 16), timed(3, 11.0, 24)])
    hub.clear_rate()  # a pause (resumed an hour later), the rows still waiting
    hub.rows.extend([timed(4, 3611.0, 32), timed(5, 3611.5, 40)])
    rates = [(s.step, s.steps_per_s, s.samples_per_s) for s in hub.samples()]
    assert rates == [(1, None, None), (2, 2.0, 16.0), (3, 2.0, 16.0), (4, None, None), (5, 2.0, 16.0)]


def test_counters_that_go_back_start_the_rate_over():
    """An own loop after fit counts its steps from its own start, and a clock may step back: a rate across
    either would be negative, so the window starts over."""
    hub = Hub()
    hub.rows.extend([timed(40, 10.0, 320), timed(41, 10.5, 328), timed(1, 11.0, 8), timed(2, 11.5, 16)])
    hub.rows.extend([timed(3, 5.0, 24), timed(4, 5.5, 32)])
    rates = [(s.step, s.steps_per_s) for s in hub.samples()]
    assert rates == [(40, None), (41, 2.0), (1, None), (2, 2.0), (3, None), (4, 2.0)]


def test_rows_wait_for_the_flush_readers_see_them_at_once_and_an_event_comes_after_them():
    hub, sink = Hub(), Seen()
    hub.add_sink(sink)
    hub.rows.append(row(1))
    hub.flush(time.monotonic())  # as RunSession.publish does, once the flush is due
    assert sink.seen == [("step", 1)] and hub.due > time.monotonic()
    hub.rows.extend([row(2), row(3)])  # two quick steps, before the next flush is due
    assert sink.seen == [("step", 1)]
    assert hub.last_step() == 3  # a signal handler's read, no lock
    assert hub.latest().step == 3 and [s.step for s in hub.samples()] == [1, 2, 3]
    assert sink.seen == [("step", 1)], "a reader's drain calls no sink"
    hub.emit(Event("remedy", 3))
    assert sink.seen == [("step", 1), ("step", 2), ("step", 3), ("remedy", 3)]
    assert [s.step for s in hub.since((0, 0))[0]] == [1, 2, 3], "each step once in the ring"


def test_a_failing_sink_is_dropped_mid_batch_and_the_others_get_every_step():
    hub, failing, other = Hub(), Seen(fail_at=2), Seen()
    hub.add_sink(failing)
    hub.add_sink(other)
    hub.rows.extend([row(1), row(2), row(3)])
    hub.flush()
    assert failing.seen == [("step", 1)]
    assert other.seen == [("step", 1), ("sink_failed", 2), ("step", 2), ("step", 3)], "named by the step it failed on"
    hub.rows.append(row(4))
    hub.flush()
    assert failing.seen == [("step", 1)] and other.seen[-1] == ("step", 4)


def test_a_sink_given_samples_gets_each_step_before_the_next_begins(hub):
    """RequestAt-style sinks steer at step N: the hub flushes every step while one is added."""

    class Samples(Sink):
        def __init__(self):
            self.steps: list[int] = []

        def on_sample(self, sample):
            self.steps.append(sample.step)

    samples, records = Samples(), Seen()
    hub.add_sink(records)
    hub.add_sink(samples)
    seen_at_forward: list[int] = []

    def step(model, batch):
        seen_at_forward.append(len(samples.steps))
        return conv_step(model, batch)

    model = ConvNet()
    gputui.fit(model, conv_batches(5, 4), step, torch.optim.SGD(model.parameters(), lr=0.01))
    assert seen_at_forward == [0, 1, 2, 3, 4]
    assert samples.steps == [1, 2, 3, 4, 5] and [s for s in records.seen if s[0] == "step"] == [
        ("step", n) for n in range(1, 6)
    ]


@pytest.mark.usefixtures("runtime_dir")
def test_steps_left_waiting_reach_an_attached_client_while_the_script_is_outside_a_step():
    hub = Hub()
    server = TelemetryServer(hub).start()
    try:
        hub.start(RunInfo(device="cpu", total_steps=10))
        hub.rows.append(row(1))
        hub.flush()
        mirror = Mirror(server.path, os.getpid()).start()
        until(lambda: mirror.hub.latest() is not None and mirror.hub.latest().step == 1)
        hub.rows.extend([row(2), row(3)])  # published before the flush was due; then the script evaluates,
        assert hub.latest().step == 3  # and reads the hub first (gputui.evaluate does): drained, not handed on
        hub.idle_since = time.time()
        until(lambda: mirror.hub.latest().step == 3, what=lambda: mirror.hub.latest().step)
        mirror.stop()
    finally:
        server.close()


def test_the_progress_line_draws_steps_the_server_thread_flushed_only_on_the_training_thread():
    """The script may be printing between steps: a line drawn from another thread could land inside it."""
    out = io.StringIO()
    line = ProgressLine(out, interval=0.0)
    line.on_start(RunInfo(device="cpu", model="Net", params=10, total_steps=9))
    started = out.getvalue()

    def server_flush():  # as the hub hands the sink a flush's steps
        line.on_record(StepRecord.of(sample(4)))
        line.flushed()

    other = threading.Thread(target=server_flush)
    other.start()
    other.join()
    assert out.getvalue() == started
    line.flushed()  # the training thread's next flush draws what the server thread kept
    assert "step 4" in out.getvalue()
    line.on_record(StepRecord.of(sample(5)))
    line.flushed()
    assert "step 5" in out.getvalue()


def test_an_event_waits_for_the_steps_a_reader_is_draining_on_another_thread(monkeypatch):
    """The reader took the last row off `rows` and has not kept its record yet: the event must not pass it."""
    hub, sink = Hub(), Seen()
    hub.add_sink(sink)
    fill, inside = hub._rate.fill, threading.Event()

    def slow_fill(row):  # the row is off `rows`, its record not made yet
        if threading.current_thread().name == "reader":
            inside.set()
            time.sleep(0.2)
        return fill(row)

    monkeypatch.setattr(hub._rate, "fill", slow_fill)
    hub.rows.append(row(1))
    reader = threading.Thread(target=hub.latest, name="reader")
    reader.start()
    assert inside.wait(5)
    hub.emit(Event("remedy", 1))
    reader.join()
    assert sink.seen == [("step", 1), ("remedy", 1)]
