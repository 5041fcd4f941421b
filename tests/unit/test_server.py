"""The telemetry server over a real Unix socket, in this process: what a client receives, what it may do."""

import os
import socket
import stat
import threading
import time

import pytest
from samples import step_sample

from gputui import jobs
from gputui.telemetry import protocol
from gputui.telemetry.client import Connection, Mirror
from gputui.telemetry.hub import Hub
from gputui.telemetry.paths import Job, UnsafeDirectory, socket_dir
from gputui.telemetry.progress import summary_line
from gputui.telemetry.run import RunInfo, RunSummary
from gputui.telemetry.sample import Event, Memory, StepRecord
from gputui.telemetry.server import TelemetryServer, serve
from gputui.telemetry.server import admission as admission_module
from gputui.telemetry.server import listener as listener_module
from gputui.telemetry.server import peers as peers_module
from gputui.telemetry.server import welcome as welcome_module

pytestmark = pytest.mark.usefixtures("runtime_dir")  # each test's sockets in its own folder


def sample(step, loss=1.0, grad_norm=None):
    return step_sample(
        step, t=1.0, loss=loss, memory=Memory("cpu", allocated=100 + step, peak=200), grad_norm=grad_norm
    )


def steps_in(record):
    """The step numbers a record carries (a steps record's rows), [] for any other."""
    return [row[1] for row in record["rows"]] if record["kind"] == "steps" else []


def until(condition, timeout=5.0, what=lambda: None):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not reached in time ({what()})"
        time.sleep(0.01)


@pytest.fixture
def served():
    hub = Hub()
    server = TelemetryServer(hub).start()
    yield hub, server
    server.close()


def test_socket_and_folder_are_private_and_removed_on_close():
    hub = Hub()
    server = TelemetryServer(hub).start()
    assert stat.S_IMODE(os.stat(server.path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(socket_dir()).st_mode) == 0o700
    assert os.path.basename(server.path) == f"{os.getpid()}.sock"
    server.close()
    assert not os.path.exists(server.path)


def test_a_client_gets_who_the_run_so_far_then_live_records(served):
    hub, server = served
    hub.start(RunInfo(device="cpu", argv=("train.py",)))
    for step in range(1, 6):
        hub.publish(sample(step, loss=1.0 / step, grad_norm=None if step == 3 else 2.0 * step))
    hub.emit(Event("paused", 5, {"reason": "test"}))
    until(lambda: len(server._so_far.events) == 1)  # the server thread took them in: the event came last
    with Connection(server.path) as conn:
        welcome = conn.welcome()
        assert welcome.hello["pid"] == os.getpid() and welcome.info.argv == ("train.py",)
        assert welcome.history["series"]["loss"]["steps"] == [1, 2, 3, 4, 5]
        assert welcome.history["series"]["grad_norm"] == {"steps": [1, 2, 4, 5], "values": [2, 4, 8, 10], "stride": 1}
        assert welcome.latest.step == 5 and [e["name"] for e in welcome.events] == ["paused"]
        hub.publish(sample(6))
        hub.end(RunSummary(steps=6))
        kinds = [conn.read()["kind"] for _ in range(2)]
        assert kinds == ["steps", "end"]


def test_the_welcome_is_built_once_per_change_of_the_run_not_per_connection(served, monkeypatch):
    hub, server = served
    built = []
    to_json = server._so_far.series.to_json  # the history: the largest part of a welcome
    monkeypatch.setattr(server._so_far.series, "to_json", lambda: built.append(1) or to_json())
    hub.start(RunInfo(device="cpu"))
    for step in range(1, 4):
        hub.publish(sample(step))
    until(lambda: not server._queue and server._so_far.last_step is not None and server._so_far.last_step.step == 3)
    with Connection(server.path) as first, Connection(server.path) as second:
        assert first.welcome().latest.step == second.welcome().latest.step == 3
    assert len(built) == 1
    hub.publish(sample(4))
    until(lambda: server._so_far.last_step.step == 4)
    with Connection(server.path) as third:
        assert third.welcome().latest.step == 4
    assert len(built) == 2


def test_a_client_connecting_long_after_is_told_how_the_job_stands_and_every_evaluation(served):
    """Past the recent events' window, a new client still gets the latest of the events that say how the
    job stands (paused, the last plan...) and the run's evaluations, in the order they came: an attach
    or `gputui jobs` long after a pause shows it paused, and the loss chart keeps its eval line."""
    hub, server = served
    hub.start(RunInfo(device="cpu", argv=("train.py",)))
    hub.publish(sample(1))
    evals = {"batches": 1, "samples": 8, "items": 8, "seconds": 0.1, "micro_batch": 8, "ooms": 0}
    hub.emit(Event("paused", 1, {"reason": "test"}))
    hub.emit(Event("resumed", 1, {}))
    for n in range(3):
        hub.emit(Event("eval", 1, {"value": float(n), **evals}))
    hub.emit(Event("paused", 1, {"reason": "test"}))
    for _ in range(welcome_module.RECENT_EVENTS + 50):  # controls applied while paused
        hub.emit(Event("cache_freed", 1, {"bytes": 0}))

    def names():
        with Connection(server.path) as conn:
            return [e["name"] for e in conn.welcome().events]

    until(lambda: names()[-1:] == ["cache_freed"] and names().count("cache_freed") == welcome_module.RECENT_EVENTS)
    assert names() == ["eval", "eval", "eval", "paused"] + ["cache_freed"] * welcome_module.RECENT_EVENTS
    assert jobs.row(Job(os.getpid(), server.path))["state"] == "paused"


def test_watch_only_cannot_steer_but_control_can(served):
    hub, server = served
    with Connection(server.path) as watcher:
        watcher.welcome()
        ident = watcher.request("halve_batch")
        reply = watcher.read()
        assert reply == {
            "v": 3,
            "kind": "error",
            "id": ident,
            "reason": "watch-only connection: attach with --control to steer",
        }
    assert len(hub.controls) == 0
    with Connection(server.path, control=True) as steer:
        steer.welcome()
        assert steer.read()["control"] is True
        ident = steer.request("set_amp", "bf16")
        ack = steer.read()
        assert ack["kind"] == "ack" and ack["id"] == ident
        queued = hub.controls.drain()
        assert [(c.action, c.value, c.id) for c in queued] == [("set_amp", "bf16", ack["request_id"])]
        assert queued[0].source == f"attach pid {os.getpid()}"
        steer.request("set_amp", "fp8")
        assert "set_amp takes one of" in steer.read()["reason"]


def test_malformed_and_oversized_messages(served):
    hub, server = served
    with Connection(server.path) as conn:
        conn.welcome()
        conn.sock.sendall(b"{not json}\n")
        assert conn.read()["reason"].startswith("not JSON")
        conn.sock.sendall(b'{"v": 3, "kind": "hello", "control": true}')  # half-written: no newline yet
        time.sleep(0.1)
        conn.sock.sendall(b"\n")
        assert conn.read() == {"v": 3, "kind": "ack", "hello": True, "control": True}
        conn.sock.sendall(b"x" * 10_000)  # no newline, past the limit: dropped
        assert "line longer than" in conn.read()["reason"]
        assert conn.read() is None
    until(lambda: server.clients == 0)


def test_a_client_that_stops_reading_is_dropped_and_the_publisher_never_waits(served, monkeypatch):
    hub, server = served
    monkeypatch.setattr(peers_module, "MAX_PENDING", 64 * 1024)  # 3000 steps: ~400 KiB, ~200 in the kernel
    stuck = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    stuck.connect(server.path)
    with Connection(server.path) as good:
        good.welcome()
        until(lambda: server.clients == 2, what=lambda: server.clients)
        steps = []

        def read_all():
            while len(steps) < 3000 and (record := good.read()) is not None:
                steps.extend(steps_in(record))

        reader = threading.Thread(target=read_all)
        reader.start()
        for step in range(1, 3001):
            hub.publish(sample(step))  # returns at once whatever the clients do
            if step % 50 == 0:
                time.sleep(0.005)  # paced like training, so a reading client keeps up
        reader.join(20)
        until(lambda: server.clients == 1, what=lambda: server.clients)  # the stuck one is gone
        assert steps == list(range(1, 3001))  # the reader lost nothing
    stuck.close()


def test_unsafe_folder_is_refused_and_training_goes_on(runtime_dir, capsys):
    folder = runtime_dir / "gputui"
    folder.mkdir(mode=0o755)
    os.chmod(folder, 0o755)
    with pytest.raises(UnsafeDirectory, match="open to other users"):
        TelemetryServer(Hub()).start()
    assert serve(Hub()) is None
    assert "gputui: attach disabled" in capsys.readouterr().err


def test_mirror_replays_the_job_and_tells_when_it_ended(served):
    hub, server = served
    hub.start(RunInfo(device="cpu", argv=("train.py",)))
    hub.publish(sample(1))
    mirror = Mirror(server.path, os.getpid()).start()
    until(lambda: mirror.generation == 1 and mirror.hub.latest() is not None)
    assert mirror.hub.info.argv == ("train.py",) and mirror.status is None
    hub.publish(sample(2))
    hub.end(RunSummary(steps=2))
    until(lambda: mirror.hub.summary is not None)
    assert mirror.hub.latest().step == 2
    server.close()
    until(lambda: mirror.ended)
    assert mirror.status == "the job finished"


def test_a_mirror_whose_job_ended_its_run_says_so_at_once_when_it_leaves(served):
    """Not "disconnected: reconnecting…" for a retry's wait while a job that said its end goes away."""
    hub, server = served
    hub.start(RunInfo(device="cpu"))
    mirror = Mirror(server.path, os.getpid(), retry=30.0).start()
    until(lambda: mirror.generation == 1)
    hub.end(RunSummary(steps=2, stopped="requested"))
    until(lambda: mirror.hub.summary is not None)
    server.close()
    until(lambda: mirror.status == "the job stopped (requested)", what=lambda: mirror.status)
    mirror.stop()


@pytest.mark.parametrize(
    ("summary", "outcome", "said"),
    [
        (RunSummary(steps=2), "finished", "the job finished"),
        (RunSummary(stopped="requested"), "stopped", "the job stopped (requested)"),
        (
            RunSummary(stopped="interrupted", error="KeyboardInterrupt: "),
            "interrupted",
            "the job was interrupted at once",
        ),
        (RunSummary(stopped="requested", error="ValueError: bad"), "failed", "the job failed: ValueError: bad"),
    ],
)
def test_how_a_run_ended_is_one_word_and_one_line(summary, outcome, said):
    """A second Ctrl-C (a KeyboardInterrupt out of a step) is an interruption, not a failure of the script:
    the summary line, `gputui jobs` and an attached screen say so."""
    mirror = Mirror("unused", None)
    mirror.hub.end(summary)
    assert summary.outcome == outcome and mirror.status_when_gone().startswith(said)
    line = summary_line(summary)
    assert line.startswith(f"gputui: {dict(finished='done', interrupted='interrupted at once').get(outcome, outcome)}")


def test_deeply_nested_json_is_refused_like_any_malformed_line(served, capfd):
    hub, server = served
    with Connection(server.path) as conn:
        conn.welcome()
        conn.sock.sendall(b"[" * 2000 + b"\n")  # under the 4 KiB line limit, past the JSON parser's recursion
        assert conn.read()["reason"] == "not JSON: nested too deeply"
        conn.send({"kind": "hello", "control": True})
        assert conn.read() == {"v": 3, "kind": "ack", "hello": True, "control": True}, "and the server goes on"
    assert "telemetry server error" not in capfd.readouterr().err


def steering(path):
    conn = Connection(path, control=True)
    conn.welcome()
    assert conn.read()["control"] is True
    return conn


def answers(conn, n):
    return [conn.read() for _ in range(n)]


def test_one_connection_may_have_only_a_few_requests_waiting(served):
    hub, server = served
    with steering(server.path) as conn:
        for _ in range(6):
            conn.request("top_tensors")  # each costs the training thread a walk of the heap
        replies = answers(conn, 6)
        assert [r["kind"] for r in replies] == ["ack"] * admission_module.MAX_CONTROLS_PER_CLIENT + ["error"] * 2
        assert "4 requests from this connection are waiting" in replies[-1]["reason"]
        queued = hub.controls.drain()
        assert len(queued) == 4
        hub.emit(Event("top_tensors", 1, queued[0].answer()))  # one answered: room for one more
        until(lambda: conn.request("top_tensors") and conn.read()["kind"] == "ack", timeout=5)


def test_all_connections_together_have_a_bound_and_a_run_end_clears_it(served, monkeypatch):
    hub, server = served
    monkeypatch.setattr(admission_module, "MAX_CONTROLS", 6)
    first, second = steering(server.path), steering(server.path)
    with first, second:
        for _ in range(4):
            first.request("snapshot")
        assert [r["kind"] for r in answers(first, 4)] == ["ack"] * 4
        for _ in range(3):
            second.request("snapshot")
        replies = answers(second, 3)
        assert [r["kind"] for r in replies] == ["ack", "ack", "error"]
        assert "6 requests from attached clients are waiting" in replies[-1]["reason"]
        hub.end(RunSummary(steps=1))  # e.g. a stop: never answered by an event, but the run is over
        until(lambda: second.read()["kind"] == "end")
        second.request("snapshot")
        assert second.read()["kind"] == "ack"


def test_past_the_total_cap_the_client_furthest_behind_is_dropped_first(served, monkeypatch):
    hub, server = served
    monkeypatch.setattr(peers_module, "MAX_BUFFERED", 2 * 2**20)
    line = len(protocol.encode({"kind": "steps", "rows": [StepRecord.of(sample(1)).row()]}))

    def stuck():
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(server.path)
        return s

    def publish(first, megabytes):
        last = first + int(megabytes * 2**20 / line)
        for step in range(first, last):
            hub.publish(sample(step))
            if step % 50 == 0:
                time.sleep(0.002)  # paced, so the reading client keeps up
        until(lambda: seen and seen[-1] == last - 1, timeout=20)
        return last

    seen = []
    with Connection(server.path) as good:
        good.welcome()
        reader = threading.Thread(
            target=lambda: seen.extend(step for r in iter(good.read, None) for step in steps_in(r)), daemon=True
        )
        reader.start()
        early = stuck()
        until(lambda: server.clients == 2)
        step = publish(1, 1.5)  # the early client is ~1.5 MiB behind
        late = stuck()
        until(lambda: server.clients == 3)
        publish(step, 1.0)  # together past 2 MiB: the early one goes, the late one (~1 MiB behind) stays
        until(lambda: server.clients == 2, what=lambda: server.clients)
        early.settimeout(10)
        while early.recv(65536):  # what the kernel held, then the end
            pass
        late.setblocking(False)
        with pytest.raises(BlockingIOError):  # the late client is still served: no end of stream
            while late.recv(2**20):
                pass
        assert seen == list(range(1, seen[-1] + 1)), "the reading client lost nothing"
        early.close()
        late.close()
        good.sock.shutdown(socket.SHUT_RDWR)
        reader.join(10)


def test_the_welcome_is_built_once_per_change_not_per_connection(served, monkeypatch):
    hub, server = served
    hub.start(RunInfo(device="cpu", argv=("train.py",)))
    hub.publish(sample(1))
    built = []
    to_json = server._so_far.series.to_json
    monkeypatch.setattr(server._so_far.series, "to_json", lambda: built.append(1) or to_json())
    so_far = server._so_far
    until(lambda: so_far.last_step is not None and so_far.last_step.step == 1)  # folded in before any welcome
    for _ in range(20):
        with Connection(server.path) as conn:
            assert conn.welcome().latest.step == 1
    assert len(built) == 1
    hub.publish(sample(2))
    until(lambda: server._so_far.last_step.step == 2)
    with Connection(server.path) as conn:
        assert conn.welcome().latest.step == 2, "a change rebuilds it"
    assert len(built) == 2


def test_one_client_too_many_is_told_and_closed(served, monkeypatch):
    hub, server = served
    monkeypatch.setattr(listener_module, "MAX_CLIENTS", 2)
    with Connection(server.path) as a, Connection(server.path) as b:
        a.welcome()
        b.welcome()
        with Connection(server.path) as c:
            assert c.read() == {"v": 3, "kind": "error", "reason": "the job serves 2 clients already"}
            assert c.read() is None
        for _ in range(20):  # a control client (gputui ctl, attach --control) is told why, not reset: its
            with Connection(server.path, control=True) as c:  # hello waits for the welcome, which never comes
                with pytest.raises(ConnectionError, match="the job refused the connection: the job serves 2 clients"):
                    c.welcome()


def test_a_job_that_trickles_its_welcome_is_given_up_on_at_the_deadline(runtime_dir):
    """A byte every 0.2 s, never a newline: each recv is within the socket's timeout, and the welcome's
    deadline still holds (a job that never says who it is must not hang ctl or attach --json)."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    path = str(runtime_dir / "slow.sock")
    listener.bind(path)
    listener.listen(1)
    done = threading.Event()

    def drip():
        conn, _ = listener.accept()
        while not done.is_set():
            conn.send(b"x")
            done.wait(0.2)
        conn.close()

    threading.Thread(target=drip, daemon=True).start()
    try:
        with Connection(path, timeout=5.0) as conn:
            start = time.monotonic()
            with pytest.raises(TimeoutError, match="did not say who it is within 1 s"):
                conn.welcome(timeout=1.0)
            assert time.monotonic() - start < 3
    finally:
        done.set()
        listener.close()


def test_a_mirror_shows_a_malformed_record_instead_of_replaying_it(runtime_dir):
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    path = str(runtime_dir / "fake.sock")
    listener.bind(path)
    listener.listen(4)
    hello = b'{"v": 3, "kind": "hello", "pid": 1, "argv": ["fake.py"], "runs": 1, "info": {"device": "cpu"}}\n'
    row = StepRecord.of(sample(1)).row()
    row[1] = "x"
    bad = protocol.encode({"kind": "steps", "rows": [row]})

    checked = threading.Event()

    def serve():
        listener.settimeout(10)
        conn, _ = listener.accept()
        conn.sendall(hello + b'{"v": 3, "kind": "live"}\n' + bad)
        checked.wait(5)  # the connection stays open while the test looks
        conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    mirror = Mirror(path, None, retry=30).start()
    try:
        until(lambda: mirror.status and "malformed" in mirror.status, what=lambda: mirror.status)
        assert "'step' is a str" in mirror.status
        assert mirror.hub.latest() is None, "nothing of the wrong type reaches the view"
    finally:
        checked.set()
        mirror.stop()
        listener.close()
        thread.join(10)


def test_a_mirror_of_a_job_of_another_protocol_version_says_so_once_and_does_not_retry(runtime_dir):
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    path = str(runtime_dir / "old.sock")
    listener.bind(path)
    listener.listen(4)
    accepted = []
    stop = threading.Event()

    def serve():  # a job of the last version, still running after an upgrade: it accepts until the test ends
        listener.settimeout(0.05)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            accepted.append(conn)
            conn.sendall(b'{"v": 1, "kind": "hello", "pid": 1, "argv": ["old.py"], "runs": 1}\n')

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    mirror = Mirror(path, None, retry=0.05).start()
    try:
        assert mirror.done.wait(5), mirror.status
        assert mirror.ended and "protocol version 1 (this side speaks" in mirror.status
        assert "use the gputui that started the job" in mirror.status
        time.sleep(0.3)  # six retries' worth: none comes
        assert len(accepted) == 1
    finally:
        mirror.stop()
        stop.set()
        thread.join(10)
        listener.close()
        for conn in accepted:
            conn.close()


def test_the_socket_appears_only_once_it_listens(monkeypatch):
    """A client that finds a job's socket can connect: between bind() and listen() it would be refused."""
    seen = []
    listen = socket.socket.listen

    def listening(sock, *args):
        seen.append(os.listdir(socket_dir()))
        return listen(sock, *args)

    monkeypatch.setattr(socket.socket, "listen", listening)
    server = TelemetryServer(Hub()).start()
    try:
        assert seen == [[f"{os.getpid()}.sock.binding"]], "not under its name before it listens"
        assert os.listdir(socket_dir()) == [f"{os.getpid()}.sock"]
    finally:
        server.close()
    assert os.listdir(socket_dir()) == []
