"""Steps travel the attach protocol as rows (sample.StepRecord.row()): one record a server turn, each step
a list of values in StepSample's field order. A client gets back exactly the sample the job published, and
refuses a row of the wrong shape or types with a line naming the field, as it does a malformed record."""

import math
from dataclasses import fields

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from samples import step_sample

from gputui.telemetry import protocol
from gputui.telemetry.checks import checked
from gputui.telemetry.client import Connection
from gputui.telemetry.hub import Hub
from gputui.telemetry.protocol import ProtocolError, clean, encode, parse_server
from gputui.telemetry.run import RunInfo
from gputui.telemetry.sample import STEP_ROW, Event, HostReading, Memory, RankMemory, StepRecord, StepSample
from gputui.telemetry.server import TelemetryServer

pytestmark = pytest.mark.usefixtures("runtime_dir")  # each test's sockets in its own folder


def full(step: int = 7) -> StepSample:
    """A sample with every field set, none at its default: memory, host reading, ranks."""
    memory = Memory(*("cuda:0", *range(1, len(fields(Memory)))))
    return StepSample(
        t=1_732_000_000.123456789,
        step=step,
        epoch=2,
        loss=0.1 + 0.2,
        batch_size=64,
        micro_batch=16,
        accumulation=4,
        amp="bf16",
        checkpointing=True,
        samples_per_s=1234.5678901,
        memory=memory,
        samples=step * 64,
        host=HostReading(rss=3 << 30, cpu_percent=187.5, system_used=10 << 30, system_total=64 << 30),
        loss_source="tqdm",
        steps_per_s=19.25,
        ranks=(RankMemory(0, 16, 5 << 30, 80 << 30, 0.3, 600.0, 1), RankMemory(1, 8, None, None, None, None, 0)),
        grad_norm=2.718281828,
    )


def over_the_wire(*samples: StepSample) -> list[StepSample]:
    line = encode({"kind": "steps", "rows": [StepRecord.of(s).row() for s in samples]})
    record = checked(parse_server(line))
    return [StepRecord.from_row(row).sample() for row in record["rows"]]


def test_a_sample_comes_back_equal_every_field_and_every_float_bit():
    sample, bare = full(), step_sample(1, t=1.5, loss=None)
    assert over_the_wire(sample, bare) == [sample, bare]


def test_the_row_layout_is_the_samples_fields_in_order():
    """A field added to StepSample (or Memory, HostReading, RankMemory) without a new protocol version and
    its type in the client's table fails here, not in a user's attach."""
    row = StepRecord.of(full()).row()
    assert len(row) == len(fields(StepSample))
    assert len(row[10]) == len(fields(Memory)) and len(row[12]) == len(fields(HostReading))
    assert all(len(rank) == len(fields(RankMemory)) for rank in row[15])


def test_the_row_is_protocol_version_3s_layout():
    """The row is read from the records' declarations (telemetry/rows.py): a field added, moved or renamed
    there changes what every step sends, which a client of version 3 would misread or refuse."""
    assert protocol.VERSION == 3
    assert STEP_ROW.names == (
        *("t", "step", "epoch", "loss", "batch_size", "micro_batch", "accumulation", "amp", "checkpointing"),
        *("samples_per_s", "memory", "samples", "host", "loss_source", "steps_per_s", "ranks", "grad_norm"),
    )
    layouts = {inner.cls: inner.names for _, inner, _ in STEP_ROW.nested}
    assert layouts[Memory] == (
        *("device", "allocated", "reserved", "fragmented", "peak", "capacity", "rss", "params", "grads"),
        *("optimizer", "activations", "alloc_retries", "ooms", "active", "device_free", "nvml_used"),
        "nvml_device_used",
    )
    assert layouts[HostReading] == ("rss", "cpu_percent", "system_used", "system_total")
    assert layouts[RankMemory] == ("rank", "micro_batch", "peak", "capacity", "loss", "samples_per_s", "ooms")


def test_a_record_gives_the_charts_its_step_loss_memory_and_grad_norm_without_a_sample():
    """The job's server folds every step into the history a welcome sends from the record's figures."""
    sample = full()
    record = StepRecord(StepRecord.of(sample).fields)
    assert record.charted() == (sample.step, sample.loss, sample.memory, sample.grad_norm)
    assert record._sample is None


def wrong(where: int | tuple[int, int], value) -> bytes:
    row = StepRecord.of(full()).row()
    if isinstance(where, tuple):
        row[where[0]] = list(row[where[0]])
        row[where[0]][where[1]] = value
    else:
        row[where] = value
    return encode({"kind": "steps", "rows": [StepRecord.of(full(1)).row(), row]})


@pytest.mark.parametrize(
    "line, reason",
    [
        (wrong(1, "x"), "row 1: 'step' is a str"),
        (wrong(1, None), "row 1: 'step' is a NoneType"),
        (wrong(4, True), "row 1: 'batch_size' is a bool"),
        (wrong(8, 1), "row 1: 'checkpointing' is an int"),
        (wrong(3, [1.0]), "row 1: 'loss' is a list"),
        (wrong(10, {"device": "cpu"}), "row 1: 'memory' is a dict"),
        (wrong(10, ["cpu", 1]), "row 1's memory is not a list of 17 values"),
        (wrong((10, 0), None), "row 1's memory: 'device' is a NoneType"),
        (wrong((10, 1), "1 GiB"), "row 1's memory: 'allocated' is a str"),
        (wrong((12, 1), [[[[1]]]]), "row 1's host reading: 'cpu_percent' is a list"),
        (wrong(15, [[0, 16]]), "row 1's rank is not a list of 7 values"),
        (wrong(15, [[0, "16", None, None, None, None, 0]]), "row 1's rank: 'micro_batch' is a str"),
        (wrong(16, "1.5"), "row 1: 'grad_norm' is a str"),
        (encode({"kind": "steps", "rows": [[1.0] * 16]}), "row 0 is not a list of 17 values"),
        (encode({"kind": "steps", "rows": {"0": []}}), "a steps record without its rows"),
        (encode({"kind": "steps"}), "a steps record without its rows"),
    ],
)
def test_a_row_of_the_wrong_shape_or_type_is_refused_naming_the_field(line, reason):
    with pytest.raises(ProtocolError, match=reason.replace("(", r"\(")):
        checked(parse_server(line))


def test_many_rows_are_parsed_without_the_walk_and_a_deep_row_is_still_refused(monkeypatch):
    """A turn's steps hold far more brackets than the depth limit: they are exempt from the count (the rows'
    shape is checked whole), so a step costs no walk; any other record is counted as before."""
    many = encode({"kind": "steps", "rows": [StepRecord.of(full(n)).row() for n in range(200)]})
    deep = encode({"kind": "steps", "rows": [[*StepRecord.of(full()).row()[:15], [[[[[[[[]]]]]]]] * 40, None]]})
    monkeypatch.setattr(protocol, "_printable", lambda *a: pytest.fail("walked"))
    assert len(checked(parse_server(many))["rows"]) == 200
    with pytest.raises(ProtocolError, match="rank is not a list of 7"):
        checked(parse_server(deep))
    with pytest.raises(pytest.fail.Exception, match="walked"):
        parse_server(encode({"kind": "event", "x": [[]] * 40}))
    with pytest.raises(pytest.fail.Exception, match="walked"):  # more than its rows: counted as any other
        parse_server(encode({"kind": "steps", "rows": [], "x": [[]] * 40}))


def test_a_nan_loss_or_grad_norm_goes_as_null_and_does_not_hold_back_the_other_steps():
    hub = Hub()
    server = TelemetryServer(hub).start()
    try:
        hub.start(RunInfo(device="cpu"))
        with Connection(server.path, timeout=5) as conn:
            conn.welcome()
            hub.publish(full(1))
            hub.publish(step_sample(2, t=1.0, loss=math.nan, grad_norm=math.inf))
            hub.publish(full(3))
            rows = []
            while len(rows) < 3:
                record = conn.read()
                rows += record["rows"] if record["kind"] == "steps" else []
    finally:
        server.close()
    loss, norm = full().loss, full().grad_norm
    assert [(row[1], row[3], row[16]) for row in rows] == [(1, loss, norm), (2, None, None), (3, loss, norm)]


def test_steps_and_events_arrive_in_the_order_they_happened():
    """Steps are batched a turn at a time; an event between two steps still arrives between them."""
    hub = Hub()
    server = TelemetryServer(hub).start()
    order = []
    try:
        hub.start(RunInfo(device="cpu"))
        with Connection(server.path, timeout=5) as conn:
            conn.welcome()
            for step in range(1, 41):
                hub.publish(full(step))
                if step % 10 == 0:
                    hub.emit(Event("paused", step, {}))
            while len(order) < 44:
                record = conn.read()
                if record["kind"] == "steps":
                    order += [("step", row[1]) for row in record["rows"]]
                elif record["kind"] == "event":
                    order.append(("paused", record["step"]))
    finally:
        server.close()
    expected = []
    for step in range(1, 41):
        expected += [("step", step)] + ([("paused", step)] if step % 10 == 0 else [])
    assert order == expected


_value = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=3)
_any = _value | st.lists(_value, max_size=18)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([None, 10, 12, 15]), st.integers(0, 17), _any), max_size=4))
def test_any_values_a_job_puts_in_a_row_are_a_step_or_a_protocol_error(changes):
    """A valid row with values replaced (at the top, in the memory, the host reading or a rank) by anything
    JSON carries: the client makes a sample of it, or refuses it with a ProtocolError; nothing else."""
    row = StepRecord.of(full()).row()
    row[10], row[12], row[15] = list(row[10]), list(row[12]), [list(rank) for rank in row[15]]
    for part, index, value in changes:
        inner = row if part is None else row[part]
        if part == 15 and isinstance(inner, list) and inner:
            inner = inner[0]
        if isinstance(inner, list) and inner:  # an earlier change may have put a scalar there
            inner[index % len(inner)] = value
    try:
        line = encode({"kind": "steps", "rows": [row]})
    except ValueError:  # a NaN or an infinity: the server cleans those before they go out
        line = encode(clean({"kind": "steps", "rows": [row]}))
    try:
        record = checked(parse_server(line))
    except ProtocolError:
        return
    StepRecord.from_row(record["rows"][0]).sample().to_json()  # what the mirror and `attach --json` make of it
