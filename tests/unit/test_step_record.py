"""A step is published as a record of its figures; its StepSample is made by the first reader that asks
(telemetry/sample.py StepRecord): never on the training thread for a sink that takes records, once for all readers."""

import io
import threading
from dataclasses import fields

import torch
from helpers import ConvNet, Sink, conv_batches, conv_step

import gputui
from gputui.telemetry.progress import ProgressLine
from gputui.telemetry.sample import StepRecord, StepSample


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.01)


class Records(Sink):
    def __init__(self) -> None:
        self.records: list[StepRecord] = []

    def on_record(self, record):
        self.records.append(record)


class Samples(Sink):
    def __init__(self) -> None:
        self.samples: list[StepSample] = []

    def on_sample(self, sample):
        self.samples.append(sample)


def test_a_record_holds_every_field_of_its_sample_in_order(hub):
    model = ConvNet()
    gputui.fit(model, conv_batches(3, 4), conv_step, sgd(model))
    sample = hub.latest()
    record = StepRecord.of(sample)
    assert record.step == sample.step and record.sample() is sample
    assert StepSample(*record.fields) == sample
    assert len(record.fields) == len(fields(StepSample))


def test_the_training_thread_makes_no_sample_for_sinks_that_take_records(hub, monkeypatch):
    made: list[str] = []
    init = StepSample.__init__

    def counted(self, *args, **kwargs):
        made.append(threading.current_thread().name)
        init(self, *args, **kwargs)

    monkeypatch.setattr(StepSample, "__init__", counted)
    records = Records()
    hub.add_sink(records)
    hub.add_sink(ProgressLine(io.StringIO(), interval=3600))  # draws the first step, and the last at the end
    model = ConvNet()
    trainer = threading.Thread(target=gputui.fit, args=(model, conv_batches(6, 4), conv_step, sgd(model)))
    trainer.start()
    trainer.join()
    assert made == [trainer.name] * 2, "the progress line's two drawings alone"
    assert [r.step for r in records.records] == [1, 2, 3, 4, 5, 6]
    samples = hub.samples()  # made here, by this reader, once: every reader gets the same objects
    assert [s.step for s in samples] == [1, 2, 3, 4, 5, 6] and made.count(threading.current_thread().name) == 4
    assert [r.sample() for r in records.records] == samples and all(
        a is b for a, b in zip(samples, hub.since((0, 0))[0], strict=True)
    )
    assert hub.latest() is samples[-1]


def test_a_sink_without_on_record_is_given_samples(hub):
    samples, records = Samples(), Records()
    hub.add_sink(samples)
    hub.add_sink(records)
    model = ConvNet()
    gputui.fit(model, conv_batches(3, 4), conv_step, sgd(model))
    assert all(type(s) is StepSample for s in samples.samples)
    assert samples.samples == hub.samples() and all(
        r.sample() is s for r, s in zip(records.records, samples.samples, strict=True)
    )
