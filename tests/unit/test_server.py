"""The telemetry server over a real Unix socket, in this process: what a client receives, what it may do."""

import os
import socket
import stat
import threading
import time

import pytest

from gputui.telemetry import server as server_module
from gputui.telemetry.client import Connection, Mirror
from gputui.telemetry.hub import Hub
from gputui.telemetry.paths import UnsafeDirectory, socket_dir
from gputui.telemetry.sample import Event, Memory, StepSample
from gputui.telemetry.server import TelemetryServer, serve


@pytest.fixture(autouse=True)
def runtime_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    return tmp_path


def sample(step, loss=1.0):
    return StepSample(t=1.0, step=step, epoch=0, loss=loss, batch_size=8, micro_batch=8, accumulation=1, amp="off",
                      checkpointing=False, samples_per_s=None, memory=Memory("cpu", allocated=100 + step, peak=200))


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
    hub.start({"device": "cpu", "argv": ["train.py"]})
    for step in range(1, 6):
        hub.publish(sample(step, loss=1.0 / step))
    hub.emit(Event("paused", 5, {"reason": "test"}))
    time.sleep(0.2)  # the server thread takes them in
    with Connection(server.path) as conn:
        welcome = conn.welcome()
        assert welcome.hello["pid"] == os.getpid() and welcome.info["argv"] == ["train.py"]
        assert welcome.history["series"]["loss"]["steps"] == [1, 2, 3, 4, 5]
        assert welcome.latest["step"] == 5 and [e["name"] for e in welcome.events] == ["paused"]
        hub.publish(sample(6))
        hub.end({"steps": 6, "error": None})
        kinds = [conn.read()["kind"] for _ in range(2)]
        assert kinds == ["step", "end"]


def test_watch_only_cannot_steer_but_control_can(served):
    hub, server = served
    with Connection(server.path) as watcher:
        watcher.welcome()
        ident = watcher.request("halve_batch")
        reply = watcher.read()
        assert reply == {"v": 1, "kind": "error", "id": ident,
                         "reason": "watch-only connection: attach with --control to steer"}
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
        conn.sock.sendall(b'{"v": 1, "kind": "hello", "control": true}')  # half-written: no newline yet
        time.sleep(0.1)
        conn.sock.sendall(b"\n")
        assert conn.read() == {"v": 1, "kind": "ack", "hello": True, "control": True}
        conn.sock.sendall(b"x" * 10_000)  # no newline, past the limit: dropped
        assert "line longer than" in conn.read()["reason"]
        assert conn.read() is None
    until(lambda: server.clients == 0)


def test_a_client_that_stops_reading_is_dropped_and_the_publisher_never_waits(served, monkeypatch):
    hub, server = served
    monkeypatch.setattr(server_module, "MAX_PENDING", 256 * 1024)
    stuck = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    stuck.connect(server.path)
    with Connection(server.path) as good:
        good.welcome()
        until(lambda: server.clients == 2, what=lambda: server.clients)
        steps = []

        def read_all():
            while len(steps) < 3000 and (record := good.read()) is not None:
                if record["kind"] == "step":
                    steps.append(record["step"])

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
    hub.start({"device": "cpu", "argv": ["train.py"]})
    hub.publish(sample(1))
    mirror = Mirror(server.path, os.getpid()).start()
    until(lambda: mirror.generation == 1 and mirror.hub.latest() is not None)
    assert mirror.hub.info["argv"] == ["train.py"] and mirror.status is None
    hub.publish(sample(2))
    hub.end({"steps": 2, "error": None, "stopped": None})
    until(lambda: mirror.hub.summary is not None)
    assert mirror.hub.latest().step == 2
    server.close()
    until(lambda: mirror.ended)
    assert mirror.status == "the job finished"
