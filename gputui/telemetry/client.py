"""The client side of the attach protocol: one connection, and a mirror that keeps reconnecting.

`Connection` is blocking and simple (jobs, ctl, attach --json). `Mirror` runs a connection in a
thread and replays what it receives into a local Hub, so the TUI reads a remote job exactly as
it reads a local one; on a lost connection it retries every second, and tells apart a job
that ended (its socket is gone) from one that is only unreachable.

A client trusts no job blindly: the peer must run as the same user (paths.check_peer), every
string arrives stripped of control characters (protocol.parse_server), and the fields the
clients read are type-checked (checks.checked), so a broken or fake job is a one-line error,
never a traceback or a garbled terminal.
"""

from __future__ import annotations

import itertools
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

from .checks import checked
from .hub import Hub
from .output import left_out
from .paths import ForeignPeer, check_peer, pid_alive
from .protocol import MAX_SERVER_LINE, ProtocolError, VersionMismatch, encode, parse_server
from .run import RunInfo, RunSummary
from .sample import Event, GpuReading, StepRecord, StepSample

CONNECT_WAIT = 5.0
"""Seconds a connection waits for room in a job's listen backlog (full while others connect)."""

WELCOME_WAIT = 5.0
"""Seconds a job may take to say who it is."""

MAX_WELCOME = 10_000
"""Records a welcome may hold (the server sends a few hundred): past it, not a gputui job."""


class Connection:
    def __init__(
        self, path: str, *, control: bool = False, timeout: float | None = 5.0, sock: socket.socket | None = None
    ) -> None:
        """Connect (waiting for room in a full backlog, CONNECT_WAIT s at most); ForeignPeer if the
        job runs as another user, another OSError if it cannot be reached. `sock`: connected already
        (`gputui run`'s screen is started with one end of a socket pair)."""
        self.path = path
        self.sock = sock or socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._timeout = timeout
        self._ids = itertools.count(1)
        self._control = control  # asked for in the hello, sent once the job has said who it is (live())
        self._buffer = bytearray()  # received, not yet a whole record
        try:
            if sock is None:
                self._connect(CONNECT_WAIT if timeout is None else timeout)
            check_peer(self.sock)
            self.sock.settimeout(timeout)
        except BaseException:
            self.sock.close()
            raise

    def _connect(self, wait: float) -> None:
        deadline, pause = time.monotonic() + wait, 0.005
        self.sock.settimeout(wait)
        while True:
            try:
                self.sock.connect(self.path)
                return
            except BlockingIOError:  # EAGAIN: the backlog is full; the job accepts them as it can
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"the job did not accept the connection within {wait:g} s (its backlog is full)"
                    ) from None
                time.sleep(min(pause, left))
                pause = min(pause * 2, 0.1)

    def read(self, deadline: float | None = None) -> dict[str, Any] | None:
        """The next record (its fields checked: ProtocolError if not), or None at the end of the stream.
        TimeoutError past `deadline` (time.monotonic()), however the job trickles its bytes, or when the
        socket's timeout passes with nothing received."""
        while (end := self._buffer.find(b"\n")) < 0:
            if len(self._buffer) > MAX_SERVER_LINE:
                raise ProtocolError("a record longer than the limit: not a gputui job?")
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("timed out")
                self.sock.settimeout(left if self._timeout is None else min(left, self._timeout))
            chunk = self.sock.recv(65536)
            if not chunk:
                return None  # the end of the stream, or cut off mid-line: the job went away
            self._buffer += chunk
        line = bytes(self._buffer[: end + 1])
        del self._buffer[: end + 1]
        return checked(parse_server(line))

    def live(self) -> None:
        """The job has said who it is (its `live` record): now the hello asks for control, if wanted. Sent
        first, it met a job that refuses the connection (full) unread, and the refusal became a reset."""
        if self._control:
            self.send({"kind": "hello", "control": True})

    def send(self, record: dict[str, Any]) -> None:
        self.sock.sendall(encode(record))

    def request(self, action: str, value: Any = None) -> int:
        """Send a control request; returns the id its ack or error will carry."""
        ident = next(self._ids)
        self.send({"kind": "control", "id": ident, "action": action, "value": value})
        return ident

    def welcome(self, timeout: float = WELCOME_WAIT) -> Welcome:
        """Read everything up to the "live" marker: who the job is, and where it stands.
        TimeoutError if that takes over `timeout` s (a job that trickles records counts too)."""
        welcome, deadline = Welcome(), time.monotonic() + timeout
        for _ in range(MAX_WELCOME):
            try:
                record = self.read(deadline)
            except TimeoutError:
                break
            if record is None:
                raise ConnectionError("the job closed the connection before saying who it is")
            if record["kind"] == "error" and "id" not in record:  # refused before a welcome: the job says why
                raise ConnectionError(f"the job refused the connection: {' '.join(str(record['reason']).split())}")
            if record["kind"] == "live":
                self.sock.settimeout(self._timeout)
                self.live()
                return welcome
            welcome.add(record)
        else:
            raise ProtocolError(f"over {MAX_WELCOME} records before the live ones: not a gputui job?")
        raise TimeoutError(f"the job did not say who it is within {timeout:g} s")

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class Welcome:
    hello: dict[str, Any] | None = None
    history: dict[str, Any] | None = None
    latest: StepSample | None = None
    gpus: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def add(self, record: dict[str, Any]) -> None:
        kind = record["kind"]
        if kind == "hello":
            self.hello = record
        elif kind == "history":
            self.history = record
        elif kind == "steps" and record["rows"]:
            self.latest = StepRecord.from_row(record["rows"][-1]).sample()
        elif kind == "event":
            self.events.append(record)
        elif kind == "gpus":
            self.gpus = record

    @property
    def info(self) -> RunInfo | None:
        info = (self.hello or {}).get("info")
        return RunInfo.from_json(info) if info else None


class Mirror:
    """A job's telemetry replayed into a local Hub, reconnecting until the job is gone."""

    def __init__(
        self,
        path: str,
        pid: int | None,
        *,
        control: bool = False,
        retry: float = 1.0,
        sock: socket.socket | None = None,
    ) -> None:
        """`sock`: a connection made already, served once (`gputui run`'s screen): when it ends, so has
        the job."""
        self.path, self.pid, self.control, self.retry = path, pid, control, retry
        self._sock = sock
        self.hub = Hub()
        self.history: dict[str, tuple[list[int], list[float], int]] | None = None
        self.generation = 0  # bumped on every (re)connection: the view starts over from the welcome
        self.printed = 0  # lines of the job's output replayed, over all connections: a welcome repeats some
        self.status: str | None = "connecting…"
        self.ended = False
        self.script_ended: Event | None = None  # the job's script has ended: its exit code and report
        self.done = threading.Event()  # set once script_ended is, or the job is gone
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
        done, answer = threading.Event(), list[dict[str, Any]]()
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
        try:
            self._connections()
        finally:
            self.done.set()

    def _connections(self) -> None:
        while not self._stop.is_set():
            try:
                conn = Connection(self.path, control=self.control, timeout=None, sock=self._sock)
            except ForeignPeer as exc:
                self.ended, self.status = True, f"refused: {exc}"
                return
            except OSError:
                gone = self._sock is not None or not os.path.exists(self.path)
                if gone or (self.pid is not None and not pid_alive(self.pid)):
                    self.ended = True
                    self.status = self.status_when_gone()
                    return
                self.status = "disconnected: reconnecting…"
                self._stop.wait(self.retry)
                continue
            self._conn = conn
            status = "disconnected: reconnecting…"
            try:
                self._receive(conn)
            except ConnectionRefusedError as exc:
                status = f"refused: {exc}: reconnecting…"
            except OSError:
                pass
            except VersionMismatch as exc:  # the same on every connection: said, not retried
                self.ended, self.status = True, f"cannot read the job: {exc}"
                return
            except (ProtocolError, ValueError, KeyError, TypeError) as exc:  # not what a gputui job sends
                status = f"the job sent a malformed record ({type(exc).__name__}: {str(exc)[:120]}): reconnecting…"
            finally:
                self._conn = None
                conn.close()
            if self._sock is not None:  # served once: the job has gone
                self.ended, self.status = True, self.status_when_gone()
                return
            if not self._stop.is_set():
                ended = self.hub.summary is not None and status.startswith("disconnected")
                self.status = self.status_when_gone() if ended else status  # its run had ended: it is leaving
                self._stop.wait(self.retry)

    def status_when_gone(self) -> str:
        summary = self.hub.summary
        if summary is None:
            return "the job is gone without a final record (killed?): the last figures it sent are shown"
        outcome = summary.outcome
        if outcome == "failed":
            return f"the job failed: {summary.error}"
        if outcome == "interrupted":
            return "the job was interrupted at once (a second Ctrl-C)"
        return f"the job {outcome}" + (f" ({summary.stopped})" if outcome == "stopped" else "")

    def _receive(self, conn: Connection) -> None:
        hub = Hub()
        history: dict[str, tuple[list[int], list[float], int]] = {}
        while (record := conn.read()) is not None:
            kind = record["kind"]
            if kind == "hello":
                if record.get("info"):
                    hub.start(RunInfo.from_json(record["info"]))
                if record.get("summary"):
                    hub.end(RunSummary.from_json(record["summary"]))
                hub.runs = int(record.get("runs") or 0)
                hub.idle_since = record.get("idle_since")
            elif kind == "idle":
                hub.idle_since = record.get("since")
            elif kind == "history":
                for name, series in (record.get("series") or {}).items():
                    history[name] = (list(series["steps"]), list(series["values"]), int(series["stride"]))
            elif kind == "live":
                self.hub, self.history = hub, history
                self.generation += 1
                self.status = None
                conn.live()
            elif kind == "start":
                hub.start(RunInfo.from_json(record["info"]))
                hub.runs = int(record.get("runs") or hub.runs)
            elif kind == "steps":
                for row in record["rows"]:
                    hub.publish_record(StepRecord.from_row(row))
            elif kind == "event":
                event = Event.from_json(record)
                hub.emit(event)
                if event.name == "script_ended":
                    self.script_ended = event
                    self.done.set()
            elif kind == "end":
                hub.end(RunSummary.from_json(record["summary"]))
            elif kind == "gpus":
                hub.publish_gpus(GpuReading.from_json(record))
            elif kind == "output":
                self._replay_output(hub, record)
            elif kind == "error" and "id" not in record:  # refused (the job serves its most clients already)
                raise ConnectionRefusedError(" ".join(str(record["reason"]).split()))
            elif kind in ("ack", "error") and "id" in record:
                with self._lock:
                    waiting = self._acks.pop(record["id"], None)
                if waiting is not None:
                    waiting[1].append(record)
                    waiting[0].set()

    def _replay_output(self, hub: Hub, record: dict[str, Any]) -> None:
        """The job's output lines this mirror has not replayed yet (a reconnection's welcome repeats
        some), after a line saying how many it never got, and why."""
        lines: list[str] = record.get("lines") or []
        dropped = record.get("dropped") or 0
        total = record.get("total")
        total = self.printed + dropped + len(lines) if total is None else total
        new = max(0, total - self.printed)
        lines = lines[len(lines) - new :] if new < len(lines) else lines
        gap = new - len(lines)
        if gap > 0:
            if dropped:
                why = "the job printed faster than attach sends"
            else:
                why = "printed while disconnected" if self.printed else "printed before attaching"
            lines = [left_out(gap, why), *lines]
        self.printed = max(self.printed, total)
        hub.output.add(lines, record.get("current"))


def wait_for_answer(conn: Connection, request_id: int, timeout: float) -> dict[str, Any] | None:
    """Read records until the event that answers `request_id`, or what says it will not soon: the run's
    `end` record (a request is over with its run), an `idle` one (the script left its steps: the request
    waits for the next), or `{"kind": "closed"}` (the job closed the connection without one); None after
    `timeout` s."""
    deadline = time.monotonic() + timeout
    while deadline > time.monotonic():
        try:
            record = conn.read(deadline)
        except TimeoutError:
            return None
        if record is None:
            return {"kind": "closed"}
        kind = record["kind"]
        if kind == "end" or (kind == "idle" and record.get("since")):
            return record
        if kind == "event" and record.get("request_id") == request_id:
            return record
    return None
