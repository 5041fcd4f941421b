"""The telemetry server in every training process: the hub on a Unix socket, for `gputui attach`.

A hub sink on the training thread only appends to a deque; one server thread does the rest:
accepts, serializes each record once, fans it out into per-client buffers and writes what
each socket takes. A client that falls more than MAX_PENDING behind is dropped (it missed
what it missed; nothing is resent), and past MAX_BUFFERED for all clients together the one
furthest behind goes first, so stuck or hostile clients cost the job a bounded few megabytes.
Only the owning user can connect (0700 folder, 0600 socket, and the peer's uid checked where
the OS tells it); only a connection that asked for control may steer, and only a few requests
at a time (each may cost the training thread a step's worth of work). The script's output goes out
as whole lines, at a bounded rate: a script printing in a tight loop costs the clients (and this
thread's share of the GIL) no more than a steady trickle, and they are told how much they missed.
"""

from __future__ import annotations

import atexit
import os
import selectors
import socket
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from .history import RunSeries
from .hub import Hub
from .paths import UnsafeDirectory, find_jobs, peer_uid, private_dir, socket_path
from .protocol import MAX_CLIENT_LINE, ProtocolError, clean, encode, parse_client
from .run import RunInfo, RunSummary
from .sample import Event, StepRecord, StepSample

MAX_PENDING = 8 * 2**20
"""Bytes waiting for one client before it counts as too slow and is dropped."""

MAX_BUFFERED = 32 * 2**20
"""Bytes waiting for all clients together; past it the client furthest behind is dropped first."""

MAX_CLIENTS = 64
"""Connections served at once; one more is told so and closed."""

BACKLOG = 128
"""Connections the kernel holds until the server thread accepts them (a client waits when full)."""

MAX_ACCEPTS = 64
"""Connections accepted in one turn, so a flood of them cannot starve the records."""

MAX_CONTROLS_PER_CLIENT = 4
"""Requests one connection may have waiting (queued, or applied but not yet answered)."""

MAX_CONTROLS = 16
"""Requests all connections together may have waiting: a `top_tensors` costs ~0.2 s of training."""

TICK = 0.05
"""Seconds the server thread sleeps at most: the latency a record may take to leave."""

RECENT_EVENTS = 200
"""Events a new client receives as the past."""

RECENT_OUTPUT = 200
"""Lines of the script's output a new client receives as the past."""

OUTPUT_LINES = 1000
"""Lines of output a second sent at most (a second's worth at once): past it the older lines of a
turn are dropped, and the record says how many."""

OUTPUT_CHARS = 256 * 1024
"""Characters of output a second sent at most, likewise (lines are cut at output.LINE_LIMIT): a flood
of long lines costs a client at most this (a few times it in JSON) a second."""


class _Budget:
    """Output lines and characters the clients may get now: refilled at OUTPUT_LINES and OUTPUT_CHARS
    a second, up to one second's worth."""

    def __init__(self) -> None:
        self.lines, self.chars, self._at = float(OUTPUT_LINES), float(OUTPUT_CHARS), time.monotonic()

    def take(self, lines: list[str]) -> list[str]:
        """The newest of `lines` the budget allows (spent)."""
        now = time.monotonic()
        self.lines = min(float(OUTPUT_LINES), self.lines + (now - self._at) * OUTPUT_LINES)
        self.chars = min(float(OUTPUT_CHARS), self.chars + (now - self._at) * OUTPUT_CHARS)
        self._at = now
        kept = _newest(lines, int(self.lines), int(self.chars))
        self.lines -= len(kept)
        self.chars -= sum(map(len, kept))
        return kept


def _newest(lines: list[str], count: int, chars: int) -> list[str]:
    """The last lines of `lines`, at most `count` of them holding at most `chars` characters."""
    kept = 0
    for line in reversed(lines[-count:] if count > 0 else []):
        chars -= len(line)
        if chars < 0:
            break
        kept += 1
    return lines[len(lines) - kept :]


FOLD_AT = 4096
"""Steps kept unfolded at most: the history stays bounded (it halves) with no client for days."""


@dataclass
class _Peer:
    sock: socket.socket
    pid: int | None
    control: bool = False
    inbox: bytearray = field(default_factory=bytearray)
    outbox: bytearray = field(default_factory=bytearray)
    errors: int = 0
    waiting: set[int] = field(default_factory=set)  # its requests the job has not answered yet


class TelemetryServer:
    def __init__(self, hub: Hub, path: str | None = None) -> None:
        self.hub = hub
        self.path = path or socket_path()
        # A step as its record (the one append a step: no tuple to make), anything else as (kind, item).
        self._queue: deque[StepRecord | tuple[str, Any]] = deque(maxlen=100_000)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._listener: socket.socket | None = None
        self._selector = selectors.DefaultSelector()
        self._waker = socket.socketpair()  # written by on_event: the server thread sends events at once
        self._peers: dict[socket.socket, _Peer] = {}
        # The run as the server has seen it, for clients that connect later.
        self._info: dict[str, Any] | None = None
        self._summary: dict[str, Any] | None = None
        self._last_step: StepRecord | None = None  # as an object: encoded only when a client wants it
        self._unfolded: list[StepRecord] = []  # steps not in _series yet: folded for a welcome
        self._events: deque[dict[str, Any]] = deque(maxlen=RECENT_EVENTS)
        self._series = RunSeries()
        self._gpus: Any = None
        self._gpus_at = 0.0
        # The script's output as read from hub.output: lines read (the job's count of them), the
        # recent ones, the line being written, and how much more the clients may get now.
        self._printed = 0
        self._output_writes = 0
        self._recent_output: deque[str] = deque(maxlen=RECENT_OUTPUT)
        self._current = ""
        self._budget = _Budget()
        self._welcome: bytes | None = None  # built on the first accept after the run changed, not per accept
        self._waiting: set[int] = set()  # request ids, from every connection, not answered yet
        self.started = time.time()

    # -- the sink: the training thread only appends ---------------------------------------------
    def on_start(self, info: RunInfo) -> None:
        self._queue.append(("start", info))

    def on_sample(self, sample: StepSample) -> None:
        self.on_record(StepRecord.of(sample))

    def on_record(self, record: StepRecord) -> None:
        self._queue.append(record)  # a client gets its row; no sample is made for it

    def on_event(self, event: Event) -> None:
        self._queue.append(("event", event))
        self._wake()  # events answer controls: a client waits for them, not for the next tick

    def _wake(self) -> None:
        try:
            self._waker[1].send(b"\0")
        except (BlockingIOError, OSError):  # a wake-up is pending already, or the server is closing
            pass

    def on_end(self, summary: RunSummary) -> None:
        self._queue.append(("end", summary))

    # -- lifetime -----------------------------------------------------------------------------------
    def start(self, *, listen: bool = True) -> TelemetryServer:
        """Bind and serve; OSError or UnsafeDirectory if the socket cannot be made safely. Without
        `listen`: no socket in the folder, only the connections given to adopt()."""
        if listen:
            private_dir()
            find_jobs()  # removes the sockets of jobs killed with SIGKILL: they could not remove their own
            # Bound and listening under another name, then renamed into place: a client that finds the
            # socket can connect to it (between bind() and listen() it would be refused).
            binding = self.path + ".binding"
            for stale in (self.path, binding):  # ours by name: a dead process with our pid left it
                if os.path.lexists(stale):
                    os.unlink(stale)
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                listener.bind(binding)
                os.chmod(binding, 0o600)
                listener.listen(BACKLOG)
                os.rename(binding, self.path)
            except BaseException:
                listener.close()
                if os.path.lexists(binding):
                    os.unlink(binding)
                raise
            listener.setblocking(False)
            self._listener = listener
            self._selector.register(listener, selectors.EVENT_READ, None)
        for end in self._waker:
            end.setblocking(False)
        self._selector.register(self._waker[0], selectors.EVENT_READ, self._waker)
        self.hub.add_sink(self)
        self._thread = threading.Thread(target=self._serve, name="gputui-telemetry", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Send what is queued, close every connection, remove the socket."""
        if self._thread is None or self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=2)
        self.hub.remove_sink(self)
        for peer in list(self._peers.values()):
            self._drop(peer)
        if self._listener is not None:
            self._listener.close()
        for end in self._waker:
            end.close()
        if self._listener is not None:
            try:
                os.unlink(self.path)
            except OSError:
                pass

    @property
    def clients(self) -> int:
        return len(self._peers)

    # -- the server thread ----------------------------------------------------------------------------
    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                self._turn()
            except Exception as exc:
                sys.stderr.write(f"gputui: telemetry server error: {type(exc).__name__}: {exc}\n")
                time.sleep(TICK)
        self._broadcast_queue()  # the last records (the end line, the last lines printed) before closing
        self._broadcast_output()
        for peer in list(self._peers.values()):
            self._flush(peer, final=True)

    def _turn(self) -> None:
        for key, mask in self._selector.select(timeout=TICK):
            if key.data is None:
                self._accept()
                continue
            if key.data is self._waker:
                try:
                    self._waker[0].recv(4096)
                except (BlockingIOError, OSError):
                    pass
                continue
            peer: _Peer = key.data
            if mask & selectors.EVENT_READ:
                self._read(peer)
            if mask & selectors.EVENT_WRITE and peer.sock in self._peers:
                self._flush(peer)
        self._broadcast_queue()
        self._broadcast_gpus()
        if self._peers:  # else a client that connects gets the recent lines in its welcome
            self._broadcast_output()
        for peer in list(self._peers.values()):
            if peer.outbox:
                self._flush(peer)
        self._cap_buffers()

    def _cap_buffers(self) -> None:
        """Past MAX_BUFFERED for all clients, drop the ones furthest behind until under it."""
        total = sum(len(peer.outbox) for peer in self._peers.values())
        for peer in sorted(self._peers.values(), key=lambda p: len(p.outbox), reverse=True):
            if total <= MAX_BUFFERED:
                return
            total -= len(peer.outbox)
            self._drop(peer)

    def _accept(self) -> None:
        assert self._listener is not None
        for _ in range(MAX_ACCEPTS):
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # out of file descriptors (the script's own): they wait in the backlog
                return
            cred = peer_uid(sock)
            if cred is not None and cred[1] != os.getuid():
                sock.close()  # another user: the folder's mode should have stopped them already
                continue
            sock.setblocking(False)
            if len(self._peers) >= MAX_CLIENTS:
                try:
                    sock.send(encode({"kind": "error", "reason": f"the job serves {MAX_CLIENTS} clients already"}))
                except OSError:
                    pass
                sock.close()
                continue
            self._add(sock, cred[0] if cred else None)

    def adopt(self, sock: socket.socket, pid: int) -> None:
        """Serve a connection made elsewhere (`gputui run`'s screen: one end of a socket pair it was
        started with), as if accepted; before start()."""
        assert self._thread is None, "adopted before the server thread runs"
        self._add(sock, pid)

    def _add(self, sock: socket.socket, pid: int | None) -> None:
        sock.setblocking(False)  # an adopted one is still blocking
        self._broadcast_output()  # the clients there have the lines the newcomer's welcome ends with
        peer = _Peer(sock, pid)
        self._peers[sock] = peer
        self._selector.register(sock, selectors.EVENT_READ, peer)
        peer.outbox += self._welcome_bytes()

    def _welcome_bytes(self) -> bytes:
        """What a new client gets before the live records: who, the run so far, the recent past.
        Built once per change of the run, so a flood of connections costs no serializing."""
        if self._welcome is None:
            hello = {
                "kind": "hello",
                "pid": os.getpid(),
                "argv": list(sys.argv),
                "server_started": self.started,
                "runs": self.hub.runs,
                "info": self._info,
                "summary": self._summary,
                "controllable": True,
            }
            self._fold()
            records = [clean(hello), clean({"kind": "history", "series": self._series.to_json()}), *self._events]
            if self._last_step is not None:
                records.append(clean({"kind": "steps", "rows": [self._last_step.row()]}))
            if self._gpus is not None:
                records.append(self._gpus)
            if self._printed or self._current:
                lines = _newest(list(self._recent_output), RECENT_OUTPUT, OUTPUT_CHARS)
                records.append(self._output_record(lines, dropped=0))
            records.append({"kind": "live"})
            self._welcome = b"".join(encode(record) for record in records)
        return self._welcome

    def _read(self, peer: _Peer) -> None:
        try:
            data = peer.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(peer)
            return
        peer.inbox += data
        while b"\n" in peer.inbox:
            line, _, rest = peer.inbox.partition(b"\n")
            peer.inbox = bytearray(rest)
            self._handle(peer, bytes(line))
            if peer.sock not in self._peers:
                return
        if len(peer.inbox) > MAX_CLIENT_LINE:
            peer.outbox += encode({"kind": "error", "reason": f"line longer than {MAX_CLIENT_LINE} bytes"})
            self._flush(peer, final=True)
            self._drop(peer)

    def _handle(self, peer: _Peer, line: bytes) -> None:
        try:
            message = parse_client(line)
        except ProtocolError as exc:
            peer.errors += 1
            peer.outbox += encode({"kind": "error", "reason": str(exc)})
            if peer.errors > 100:  # a client that only sends garbage
                self._drop(peer)
            return
        if message["kind"] == "hello":
            peer.control = message["control"]
            peer.outbox += encode({"kind": "ack", "hello": True, "control": peer.control})
            return
        ident = message["id"]
        if not peer.control:
            peer.outbox += encode(
                {"kind": "error", "id": ident, "reason": "watch-only connection: attach with --control to steer"}
            )
            return
        if len(peer.waiting) >= MAX_CONTROLS_PER_CLIENT or len(self._waiting) >= MAX_CONTROLS:
            mine = len(peer.waiting) >= MAX_CONTROLS_PER_CLIENT
            peer.outbox += encode(
                {
                    "kind": "error",
                    "id": ident,
                    "reason": (
                        f"{len(peer.waiting) if mine else len(self._waiting)} requests from "
                        f"{'this connection' if mine else 'attached clients'} are waiting for the job to apply them "
                        "(at its next step boundary): send this one when they are answered"
                    ),
                }
            )
            return
        try:
            control = self.hub.controls.request(
                message["action"], message["value"], source=f"attach pid {peer.pid}" if peer.pid else "attach"
            )
        except ValueError as exc:
            peer.outbox += encode({"kind": "error", "id": ident, "reason": str(exc)})
            return
        peer.waiting.add(control.id)
        self._waiting.add(control.id)
        peer.outbox += encode({"kind": "ack", "id": ident, "request_id": control.id})

    def _broadcast_queue(self) -> None:
        """What the run published since the last turn, to every client: the steps as rows of one
        record (one encode a turn, not one a step), each other record after the steps before it."""
        rows: list[list[Any]] = []
        queue = self._queue
        while queue:
            item = queue.popleft()
            if isinstance(item, StepRecord):
                self._step(item, rows)
                continue
            if rows:
                self._send({"kind": "steps", "rows": rows})
                rows = []
            self._send(self._record(*item))
        if rows:
            self._send({"kind": "steps", "rows": rows})

    def _send(self, record: dict[str, Any]) -> None:
        try:
            line = encode(record)
        except (TypeError, ValueError):  # a step's NaN (another rank's loss) or a value JSON has no form for
            line = encode(clean(record))  # cleaned only if it fails to encode: a walk a step
        for peer in list(self._peers.values()):
            peer.outbox += line

    def _step(self, record: StepRecord, rows: list[list[Any]]) -> None:
        """Fold a step into the server's view of the run; its row into `rows` if a client is connected
        to see it (no client, no work but an append: the training thread needs the GIL)."""
        self._welcome = None
        self._last_step = record
        if self._listener is not None:  # a later client's welcome needs the run's history
            self._unfolded.append(record)
            if len(self._unfolded) >= FOLD_AT:
                self._fold()
        if self._peers:
            rows.append(record.row())

    def _record(self, kind: str, item: Any) -> dict[str, Any]:
        """Fold a record other than a step into the server's view of the run; returns it as sent (cleaned)."""
        self._welcome = None
        if kind in ("start", "end"):  # requests left unanswered (a stop has no answer) are over with the run
            self._answered(set(self._waiting))
        if kind == "start":
            self._info, self._summary, self._last_step = item.to_json(), None, None
            self._events.clear()
            self._series.clear()
            self._unfolded.clear()
            return clean({"kind": "start", "runs": self.hub.runs, "info": self._info})
        if kind == "event":
            record = clean(item.to_json())
            self._events.append(record)
            if record.get("request_id") in self._waiting:
                self._answered({record["request_id"]})
            return record
        self._summary = item.to_json()
        return clean({"kind": "end", "summary": self._summary})

    def _fold(self) -> None:
        """The steps since the last fold into the history a welcome sends, from their records' figures
        (no sample made): when a client comes or FOLD_AT have gathered, not each step."""
        add = self._series.add
        for item in self._unfolded:
            add(*item.charted())
        self._unfolded.clear()

    def _answered(self, ids: set[int]) -> None:
        for peer in self._peers.values():
            peer.waiting -= ids
        self._waiting -= ids

    def _broadcast_output(self) -> None:
        """What the script printed since the last turn: into the recent lines, and to the clients as
        one record, within the budget (the oldest lines dropped, and counted, past it)."""
        log = self.hub.output
        if log.writes == self._output_writes:
            return
        self._output_writes = log.writes
        lines, total = log.since(self._printed, limit=max(RECENT_OUTPUT, OUTPUT_LINES))
        current = log.current
        missed = total - self._printed - len(lines)  # more than the hub's log holds since the last turn
        if not lines and not missed and current == self._current:
            return
        self._printed, self._current = total, current
        self._recent_output.extend(lines[-RECENT_OUTPUT:])
        self._welcome = None
        if not self._peers:
            return
        sent = self._budget.take(lines)
        line = encode(self._output_record(sent, dropped=missed + len(lines) - len(sent)))
        for peer in list(self._peers.values()):
            peer.outbox += line

    def _output_record(self, lines: list[str], dropped: int) -> dict[str, Any]:
        """`total`: lines the script has printed (the last of `lines` is that one), so a client that
        reconnects knows which it has; `dropped`: lines before these that were not sent."""
        return {"kind": "output", "lines": lines, "current": self._current, "total": self._printed, "dropped": dropped}

    def _broadcast_gpus(self) -> None:
        now = time.monotonic()
        if now - self._gpus_at < 1.0:
            return
        self._gpus_at = now
        reading = self.hub.gpus
        if reading is None or (self._gpus is not None and reading.t == self._gpus.get("t")):
            return
        self._gpus = clean(reading.to_json())
        self._welcome = None
        line = encode(self._gpus)
        for peer in list(self._peers.values()):
            peer.outbox += line

    def _flush(self, peer: _Peer, final: bool = False) -> None:
        while peer.outbox:
            try:
                sent = peer.sock.send(peer.outbox[:262144])
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                self._drop(peer)
                return
            del peer.outbox[:sent]
        if len(peer.outbox) > MAX_PENDING and not final:
            self._drop(peer)  # too slow: it would hold ever more memory of ours
            return
        if peer.sock in self._peers:
            wanted = selectors.EVENT_READ | (selectors.EVENT_WRITE if peer.outbox else 0)
            if self._selector.get_key(peer.sock).events != wanted:
                self._selector.modify(peer.sock, wanted, peer)

    def _drop(self, peer: _Peer) -> None:
        if self._peers.pop(peer.sock, None) is None:
            return
        try:
            self._selector.unregister(peer.sock)
        except (KeyError, ValueError):
            pass
        peer.sock.close()


def serve(hub: Hub) -> TelemetryServer | None:
    """Serve `hub` on this process's socket, unless GPUTUI_NO_SOCKET is set or it cannot be
    done safely (then one line on stderr says why, and training goes on without it)."""
    if os.environ.get("GPUTUI_NO_SOCKET"):
        return None
    server = TelemetryServer(hub)
    try:
        server.start()
    except (OSError, UnsafeDirectory) as exc:
        sys.stderr.write(f"gputui: attach disabled (cannot serve {server.path}): {exc}\n")
        return None
    atexit.register(server.close)
    return server
