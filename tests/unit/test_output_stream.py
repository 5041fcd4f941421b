"""The script's output through the hub and over a real socket: lines in order, progress bars as one
line, escape sequences gone, the recent lines in the welcome, a flood bounded and said so."""

import io
import os
import threading
import time

import pytest

from gputui.telemetry import server as server_module
from gputui.telemetry.checks import checked
from gputui.telemetry.client import Connection, Mirror
from gputui.telemetry.hub import Hub
from gputui.telemetry.output import LINE_LIMIT, LineWriter, OutputLog
from gputui.telemetry.protocol import ProtocolError
from gputui.telemetry.server import TelemetryServer
from gputui.telemetry.server.printed import OUTPUT_CHARS, OUTPUT_LINES, RECENT_OUTPUT
from gputui.tui.remote import RemoteSource
from gputui.tui.sources import LocalSource
from gputui.tui.terminal import READ, captured_stream, pump

pytestmark = pytest.mark.usefixtures("runtime_dir")  # each test's sockets in its own folder


@pytest.fixture
def served():
    hub = Hub()
    server = TelemetryServer(hub).start()
    yield hub, server
    server.close()


def until(condition, timeout=10.0, what=lambda: None):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not reached in time ({what()})"
        time.sleep(0.01)


def output_records(conn, until_line=None, until_current=None, timeout=10.0):
    """Output records as they come, until one carries `until_line` or `until_current`."""
    records, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        record = conn.read(deadline)
        assert record is not None, "the job closed the connection"
        if record["kind"] != "output":
            continue
        records.append(record)
        if until_line in record["lines"] or (until_current is not None and record["current"] == until_current):
            return records
    raise AssertionError(f"not received in time: {records[-3:]}")


def test_lines_arrive_in_order_with_bars_as_one_line_and_no_escape_sequences(served):
    hub, server = served
    with Connection(server.path) as conn:
        assert conn.welcome() is not None
        hub.output.write("epoch 1\n")
        hub.output.write("\x1b[32mgreen\x1b[0m and \x1b]0;a title\x07plain\n")  # colours, a title
        for pct in range(0, 101, 10):
            hub.output.write(f"\r{pct:3d}%|{'#' * (pct // 10):<10}|")
        records = output_records(conn, until_current="100%|##########|")
        hub.output.write("\n")
        hub.output.write("epoch 2: ")  # a line in pieces, as print() writes it
        hub.output.write("loss 0.5\n")
        records += output_records(conn, until_line="epoch 2: loss 0.5")
    lines = [line for record in records for line in record["lines"]]
    assert lines == ["epoch 1", "green and plain", "100%|##########|", "epoch 2: loss 0.5"]
    assert all(record["dropped"] == 0 for record in records)
    assert records[-1]["total"] == 4 and records[-1]["current"] == ""
    redraws = [record["current"] for record in records if "%" in record["current"]]
    assert redraws[-1] == "100%|##########|" and all("\r" not in c and "\n" not in c for c in redraws)


def test_the_welcome_carries_the_recent_lines_and_where_they_stand(served):
    hub, server = served
    for i in range(500):
        hub.output.write(f"line {i}\n")
    hub.output.write("\rloading 3/7")
    with Connection(server.path) as conn:
        records, deadline = [], time.monotonic() + 5
        while (record := conn.read(deadline))["kind"] != "live":
            records.append(record)
    [output] = [r for r in records if r["kind"] == "output"]
    assert output["lines"] == [f"line {i}" for i in range(500 - RECENT_OUTPUT, 500)]
    assert output["total"] == 500 and output["current"] == "loading 3/7" and output["dropped"] == 0


def test_a_mirror_replays_each_line_once_across_reconnections(served):
    hub, server = served
    for i in range(300):
        hub.output.write(f"before {i}\n")
    mirror = Mirror(server.path, os.getpid(), retry=0.05).start()
    try:
        source = RemoteSource(mirror, control=False)  # started over at each connection, as the app reads it
        seen: list[str] = []

        def poll():
            seen.extend(source.poll().output)
            return seen

        until(lambda: "before 299" in poll())
        assert seen[0] == "… 100 lines not shown (printed before attaching)"
        assert seen[1:] == [f"before {i}" for i in range(100, 300)]
        generation = mirror.generation
        mirror._conn.sock.shutdown(2)  # the connection drops; the mirror reconnects and gets a welcome again
        until(lambda: mirror.generation > generation)
        hub.output.write("after\n")
        until(lambda: "after" in poll())
        assert seen[1:] == [*(f"before {i}" for i in range(100, 300)), "after"], "the welcome's lines come once"
    finally:
        mirror.stop()


def test_a_flood_is_bounded_and_the_client_is_told_what_it_missed(served):
    hub, server = served
    with Connection(server.path) as conn:
        conn.welcome()
        mirror = Mirror(server.path, os.getpid()).start()
        until(lambda: mirror.generation == 1)
        printed, started = 50_000, time.monotonic()
        for i in range(printed):  # a tight loop: never waits for the clients
            hub.output.write(f"flood {i}\n")
        hub.output.write("the end\n")
        records = output_records(conn, until_line="the end", timeout=20)
        elapsed = time.monotonic() - started
    try:
        sent = sum(len(r["lines"]) for r in records)
        assert sent + sum(r["dropped"] for r in records) == printed + 1, "every line sent or counted"
        assert sent <= OUTPUT_LINES * (1 + elapsed) + 1, (sent, elapsed)
        lines = [line for r in records for line in r["lines"]]
        numbers = [int(line.split()[1]) for line in lines[:-1]]
        assert numbers == sorted(numbers) and lines[-1] == "the end", "in order, the newest kept"
        until(lambda: "the end" in mirror.hub.output.lines)
        markers = [line for line in mirror.hub.output.lines if line.startswith("…")]
        assert markers and all(m.endswith("not shown (the job printed faster than attach sends)") for m in markers)
        assert sum(int(m.split()[1]) for m in markers) == sum(r["dropped"] for r in records)
    finally:
        mirror.stop()


def test_long_lines_are_cut_and_long_lines_count_against_the_budget(served):
    hub, server = served
    with Connection(server.path) as conn:
        conn.welcome()
        hub.output.write("x" * 100_000 + "\n")
        output_records(conn, until_line="x" * LINE_LIMIT + "…")
        started = time.monotonic()
        for i in range(400):  # 400 lines of 4 KiB: past the characters a second, well under the lines
            hub.output.write(f"{i:04d}" + "y" * (LINE_LIMIT - 4) + "\n")
        hub.output.write("done\n")
        records = output_records(conn, until_line="done", timeout=20)
        elapsed = time.monotonic() - started
    chars = sum(len(line) for r in records for line in r["lines"])
    assert chars <= OUTPUT_CHARS * (1 + elapsed), (chars, elapsed)
    assert sum(len(r["lines"]) for r in records) + sum(r["dropped"] for r in records) == 401
    assert sum(r["dropped"] for r in records) > 0


def test_no_client_no_output_work_but_the_hub_keeps_the_recent_lines(served, monkeypatch):
    hub, server = served
    taken = []
    since = hub.output.since
    monkeypatch.setattr(hub.output, "since", lambda *a, **k: taken.append(1) or since(*a, **k))
    for i in range(10):
        hub.output.write(f"alone {i}\n")
    time.sleep(3 * server_module.TICK)
    assert not taken, "nobody connected: the server thread leaves the output alone"
    with Connection(server.path) as conn:
        assert conn.welcome() is not None
    assert taken, "a client's welcome reads it"


def test_checked_refuses_output_records_of_the_wrong_shape():
    good = {"kind": "output", "lines": ["a"], "current": "", "total": 1, "dropped": 0}
    assert checked(dict(good)) == good
    for bad in ({"lines": "a"}, {"lines": ["a", 3]}, {"current": 5}, {"total": "1"}, {"dropped": 1.5}):
        with pytest.raises(ProtocolError):
            checked({**good, **bad})


def test_the_log_bounds_what_a_script_writes_without_a_newline():
    log = OutputLog()
    started = time.monotonic()
    for _ in range(20_000):
        log.write("." * 100)  # 2 MB on one line: each write would copy the whole line so far
    assert time.monotonic() - started < 5
    assert log.current == "." * LINE_LIMIT + "…" and len(log._partial) <= 2 * LINE_LIMIT + 2
    log.write("\n")
    assert list(log.lines) == ["." * LINE_LIMIT + "…"]


def test_since_takes_the_newest_and_says_where_the_reader_is():
    log = OutputLog(limit=100)
    for i in range(250):
        log.write(f"{i}\n")
    lines, position = log.since(0)
    assert lines == [str(i) for i in range(150, 250)] and position == 250, "what the log still holds"
    lines, _ = log.since(200, limit=10)
    assert lines == [str(i) for i in range(240, 250)]


def test_a_local_source_brings_the_hubs_output_and_says_what_it_missed():
    hub = Hub()
    source = LocalSource(hub)
    assert not source.poll().output
    hub.output.write("one\ntwo\n\rhalf")
    update = source.poll()
    assert list(update.output) == ["one", "two"] and update.current == "half"
    update = source.poll()
    assert not update.output and update.current is None, "nothing new"
    hub.output.write("\n")  # "half" ends: a line, then more than the log holds
    for i in range(hub.output.lines.maxlen + 5):
        hub.output.write(f"{i}\n")
    update = source.poll()
    assert update.output[0] == "… 6 lines not shown (printed faster than the screen reads)"
    assert update.current == "" and update.output[-1] == str(hub.output.lines.maxlen + 4)


def test_a_line_written_without_a_newline_is_held_no_longer_than_the_log_keeps_it():
    log = OutputLog()
    lines = LineWriter(log.write)
    held = 0
    for _ in range(16):  # 16 MB on one line, as os.write(1, b"B" * 2**20) a step writes it
        lines.write(b"B" * 2**20)
        held = max(held, len(lines.held))
    assert held <= 2 * LINE_LIMIT, "never the line whole"
    assert log.current == "B" * LINE_LIMIT + "…", "shown as it comes, cut as a print's line is"
    lines.write(b"\nnext\n")
    assert list(log.lines) == ["B" * LINE_LIMIT + "…", "next"] and lines.held == ""


def test_lines_pass_whole_a_character_split_between_writes_joins_and_a_flush_sends_the_rest():
    written = []
    lines = LineWriter(written.append)
    for piece in (b"epoch 1: ", "loss é".encode()[:-1], "é".encode()[-1:], b"\n", b"\r 50%\r", b"100%\rtail"):
        lines.write(piece)
    assert written == ["epoch 1: loss é\n", "\r 50%\r", "100%\r"] and lines.held == "tail"
    lines.flush()
    assert written[-1] == "tail" and lines.held == ""


def test_the_pump_reads_the_pipe_as_it_comes_and_holds_a_bounded_piece_of_a_line():
    log = OutputLog()
    lines = LineWriter(log.write)
    held, write = [], lines.write

    def watched(data):
        n = write(data)
        held.append(len(data) + len(lines.held))
        return n

    lines.write = watched
    read_end, write_end = os.pipe()
    reader = threading.Thread(target=pump, args=(read_end, lines))
    reader.start()
    for _ in range(8):
        os.write(write_end, b"B" * 2**20)  # C code writing a megabyte a step, never a newline
    until(lambda: log.current == "B" * LINE_LIMIT + "…", what=lambda: log.current[:20])
    os.write(write_end, b"\n\r 50%")  # a progress bar: shown once nothing more comes for a moment
    until(lambda: log.current == " 50%", what=lambda: log.current[:20])
    os.write(write_end, b"\r100%\nC code's last line")
    os.close(write_end)  # the pump reads to the end, passes on the unfinished line and closes its end
    reader.join(timeout=10)
    assert not reader.is_alive() and max(held) <= READ + 2 * LINE_LIMIT
    assert list(log.lines) == ["B" * LINE_LIMIT + "…", "100%"] and log.current == "C code's last line"
    with pytest.raises(OSError):
        os.fstat(read_end)


def test_the_captured_stream_is_a_text_stream_over_bytes_as_pythons_own_is():
    log = OutputLog()
    original = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors="strict", line_buffering=True)
    out = captured_stream(log.write, 1, original)
    assert (out.encoding, out.errors, out.line_buffering, out.fileno(), out.isatty()) == (
        "utf-8",
        "strict",
        True,
        1,
        False,
    )
    assert out.buffer.fileno() == 1 and out.name == "<stdout>" and out.writable()
    print("text", end=" ", file=out)
    out.buffer.write(b"then bytes")  # in order with the text: every write goes on as it is made
    print(", then text", file=out)
    out.reconfigure(line_buffering=False, encoding="latin-1")
    assert (out.encoding, out.line_buffering) == ("latin-1", False)
    out.write("caf\xe9\n")  # latin-1 bytes, shown as a UTF-8 terminal shows them
    out.buffer.write("naïve\n".encode())
    assert list(log.lines) == ["text then bytes, then text", "caf\ufffd", "naïve"]
    out.write("no newline yet")
    assert log.current == ""
    out.flush()
    assert log.current == "no newline yet"
    with pytest.raises(TypeError):
        out.buffer.write("text to a binary stream")
