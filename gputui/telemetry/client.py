"""The client side of the attach protocol: one connection, and a mirror that keeps reconnecting.

`Connection` is blocking and simple (jobs, ctl, attach --json). `Mirror` runs a connection in a
thread and replays what it receives into a local Hub, so the TUI reads a remote job exactly as
it reads a local one; on a lost connection it retries every second, and tells apart a job
that ended (its socket is gone) from one that is only unreachable.
"""

from __future__ import annotations

import itertools
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

from .hub import Hub
from .paths import pid_alive
from .protocol import MAX_SERVER_LINE, ProtocolError, encode, parse_server
from .sample import Event, GpuReading, StepSample


class Connection:
    def __init__(self, path: str, *, control: bool = False, timeout: float | None = 5.0) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        try:
            self.sock.connect(path)
        except OSError:
            self.sock.close()
            raise
        self._file = self.sock.makefile("rb")
        self._ids = itertools.count(1)
        if control:
            self.send({"kind": "hello", "control": True})

    def read(self) -> dict[str, Any] | None:
        """The next record, or None at the end of the stream."""
        line = self._file.readline(MAX_SERVER_LINE + 1)
        if not line:
            return None
        if not line.endswith(b"\n"):
            if len(line) > MAX_SERVER_LINE:
                raise ProtocolError("a record longer than the limit: not a gputui job?")
            return None  # cut off mid-line: the job went away
        return parse_server(line)

    def send(self, record: dict[str, Any]) -> None:
        self.sock.sendall(encode(record))

    def request(self, action: str, value: Any = None) -> int:
        """Send a control request; returns the id its ack or error will carry."""
        ident = next(self._ids)
        self.send({"kind": "control", "id": ident, "action": action, "value": value})
        return ident

    def welcome(self) -> Welcome:
        """Read everything up to the "live" marker: who the job is, and where it stands."""
        welcome = Welcome()
        while (record := self.read()) is not None:
            kind = record["kind"]
            if kind == "live":
                return welcome
            welcome.add(record)
        raise ConnectionError("the job closed the connection before saying who it is")

    def settimeout(self, timeout: float | None) -> None:
        self.sock.settimeout(timeout)

    def close(self) -> None:
        try:
            self._file.close()
        finally:
            self.sock.close()

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class Welcome:
    hello: dict[str, Any] | None = None
    history: dict[str, Any] | None = None
    latest: dict[str, Any] | None = None
    gpus: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def add(self, record: dict[str, Any]) -> None:
        kind = record["kind"]
        if kind == "hello":
            self.hello = record
        elif kind == "history":
            self.history = record
        elif kind == "step":
            self.latest = record
        elif kind == "event":
            self.events.append(record)
        elif kind == "gpus":
            self.gpus = record

    @property
    def info(self) -> dict[str, Any]:
        return (self.hello or {}).get("info") or {}


class _Latest:
    """Stands in for an NvmlPoller on the client side: the job's last GPU reading."""

    def __init__(self) -> None:
        self.reading: GpuReading | None = None

    def latest(self) -> GpuReading | None:
        return self.reading


class Mirror:
    """A job's telemetry replayed into a local Hub, reconnecting until the job is gone."""

    def __init__(self, path: str, pid: int | None, *, control: bool = False, retry: float = 1.0) -> None:
        self.path, self.pid, self.control, self.retry = path, pid, control, retry
        self.hub = Hub()
        self.hub.gpu_poller = _Latest()
        self.history: dict[str, tuple[list[int], list[float], int]] | None = None
        self.generation = 0  # bumped on every (re)connection: the view starts over from the welcome
        self.status: str | None = "connecting…"
        self.ended = False
        self._conn: Connection | None = None
        self._acks: dict[int, tuple[threading.Event, list[Any]]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gputui-attach", daemon=True)

    def start(self) -> Mirror:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        conn = self._conn
        if conn is not None:
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def request(self, action: str, value: Any = None, timeout: float = 3.0) -> int | None:
        """Send a control; returns the job's request id (events answering it carry it).

        Raises RuntimeError with the job's reason when it refuses (watch-only, bad value)."""
        conn = self._conn
        if conn is None:
            raise RuntimeError("not connected to the job")
        done, answer = threading.Event(), []
        with self._lock:
            ident = conn.request(action, value)
            self._acks[ident] = (done, answer)
        if not done.wait(timeout):
            raise RuntimeError("the job did not answer the request")
        record = answer[0]
        if record["kind"] == "error":
            raise RuntimeError(record.get("reason", "refused"))
        return int(record["request_id"])

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn = Connection(self.path, control=self.control, timeout=None)
            except OSError:
                if not os.path.exists(self.path) or (self.pid is not None and not pid_alive(self.pid)):
                    self.ended = True
                    self.status = self.status_when_gone()
                    return
                self.status = "disconnected: reconnecting…"
                self._stop.wait(self.retry)
                continue
            self._conn = conn
            try:
                self._receive(conn)
            except (OSError, ProtocolError, ValueError, KeyError, TypeError):
                pass
            finally:
                self._conn = None
                conn.close()
            if not self._stop.is_set():
                self.status = "disconnected: reconnecting…"
                self._stop.wait(self.retry)

    def status_when_gone(self) -> str:
        summary = self.hub.summary
        if summary is None:
            return "the job is gone without a final record (killed?): the last figures it sent are shown"
        if summary.get("error"):
            return f"the job failed: {summary['error']}"
        return "the job finished" + (f" ({summary['stopped']})" if summary.get("stopped") else "")

    def _receive(self, conn: Connection) -> None:
        hub = Hub()
        hub.gpu_poller = _Latest()
        history: dict[str, tuple[list[int], list[float], int]] = {}
        while (record := conn.read()) is not None:
            kind = record["kind"]
            if kind == "hello":
                if record.get("info"):
                    hub.start(record["info"])
                if record.get("summary"):
                    hub.end(record["summary"])
                hub.runs = int(record.get("runs") or 0)
            elif kind == "history":
                for name, series in (record.get("series") or {}).items():
                    history[name] = (list(series["steps"]), list(series["values"]), int(series["stride"]))
            elif kind == "live":
                self.hub, self.history = hub, history
                self.generation += 1
                self.status = None
            elif kind == "start":
                hub.start(record["info"])
                hub.runs = int(record.get("runs") or hub.runs)
            elif kind == "step":
                hub.publish(StepSample.from_json(record))
            elif kind == "event":
                hub.emit(Event.from_json(record))
            elif kind == "end":
                hub.end(record["summary"])
            elif kind == "gpus":
                hub.gpu_poller.reading = GpuReading.from_json(record)
            elif kind in ("ack", "error") and "id" in record:
                with self._lock:
                    waiting = self._acks.pop(record["id"], None)
                if waiting is not None:
                    waiting[1].append(record)
                    waiting[0].set()


def wait_for_answer(conn: Connection, request_id: int, timeout: float) -> dict[str, Any] | None:
    """Read records until the event that answers `request_id` (or None after `timeout` s)."""
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        conn.settimeout(left)
        try:
            record = conn.read()
        except (socket.timeout, TimeoutError):
            return None
        if record is None:
            return None
        if record["kind"] == "event" and record.get("request_id") == request_id:
            return record
    return None
