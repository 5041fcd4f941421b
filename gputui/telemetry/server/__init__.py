"""The telemetry server in every training process: the hub on a Unix socket, for `gputui attach`.

A hub sink (called at the hub's flushes) only appends to a deque; one server thread does the rest, each
job in its own module: accepting connections (listener.py: only the owning user gets in), the
welcome a new client gets (welcome.py: the run so far), serializing each record once and fanning it
out into per-client buffers with back-pressure (peers.py), the script's output at a bounded rate
(printed.py), and what a client may ask (admission.py: only a connection that asked for control
may steer, a few requests at a time).
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
from collections.abc import Callable
from typing import Any

from ..hub import Hub
from ..paths import UnsafeDirectory, socket_path
from ..protocol import clean, encode
from ..run import RunInfo, RunSummary
from ..sample import Event, StepRecord, StepSample
from .admission import Admission
from .listener import Listener
from .peers import Peers
from .printed import Printed
from .welcome import RunSoFar

TICK = 0.05
"""Seconds the server thread sleeps at most: the latency a record may take to leave."""


class TelemetryServer:
    def __init__(self, hub: Hub, path: str | None = None) -> None:
        self.hub = hub
        self.path = path or socket_path()
        # A step as its record (the one append a step: no tuple to make), anything else as (kind, item).
        self._queue: deque[StepRecord | tuple[str, Any]] = deque(maxlen=100_000)
        # A step's record goes straight into the queue (a client gets its row; no sample is made for
        # it): the hub's flush calls the deque's own append, no Python frame.
        self.on_record: Callable[[StepRecord], None] = self._queue.append
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._listener: Listener | None = None
        self._selector = selectors.DefaultSelector()
        self._waker = socket.socketpair()  # written by on_event: the server thread sends events at once
        self._peers = Peers(self._selector)
        self._admission = Admission(hub.controls, self._peers)
        self._printed = Printed(hub.output)
        self._so_far = RunSoFar(hub, self._printed)

    # -- the sink: the training thread only appends ---------------------------------------------
    def on_start(self, info: RunInfo) -> None:
        self._queue.append(("start", info))

    def on_sample(self, sample: StepSample) -> None:
        self.on_record(StepRecord.of(sample))

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
            self._listener = Listener(self.path)
            self._selector.register(self._listener.sock, selectors.EVENT_READ, None)
        self._so_far.later = listen
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
        self._wake()  # out of its select now, not at its next tick
        self._thread.join(timeout=2)
        self.hub.remove_sink(self)
        for peer in self._peers:
            self._peers.drop(peer)
        if self._listener is not None:
            self._listener.close()
        for end in self._waker:
            end.close()

    @property
    def clients(self) -> int:
        return len(self._peers)

    def adopt(self, sock: socket.socket, pid: int) -> None:
        """Serve a connection made elsewhere (`gputui run`'s screen: one end of a socket pair it was
        started with), as if accepted; before start()."""
        assert self._thread is None, "adopted before the server thread runs"
        self._add(sock, pid)

    # -- the server thread ----------------------------------------------------------------------------
    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                self._turn()
            except Exception as exc:
                sys.stderr.write(f"gputui: telemetry server error: {type(exc).__name__}: {exc}\n")
                time.sleep(TICK)
        self.hub.flush()
        self._broadcast_queue()  # the last records (the end line, the last lines printed) before closing
        self._broadcast_output()
        for peer in self._peers:
            self._peers.flush(peer, final=True)

    def _turn(self) -> None:
        for key, mask in self._selector.select(timeout=TICK):
            if key.data is None:
                assert self._listener is not None
                for sock, pid in self._listener.accept(len(self._peers)):
                    self._add(sock, pid)
                continue
            if key.data is self._waker:
                try:
                    self._waker[0].recv(4096)
                except (BlockingIOError, OSError):
                    pass
                continue
            peer = key.data
            if mask & selectors.EVENT_READ:
                self._admission.read(peer)
            if mask & selectors.EVENT_WRITE and peer in self._peers:
                self._peers.flush(peer)
        self.hub.flush_due()  # steps left waiting (the script works outside a step): sent now, not at its next
        self._broadcast_queue()
        for record in (self._so_far.gpus_record(), self._so_far.idle_record()):
            if record is not None:
                self._peers.send(encode(record))
        if self._peers:  # else a client that connects gets the recent lines in its welcome
            self._broadcast_output()
        self._peers.flush_all()

    def _add(self, sock: socket.socket, pid: int | None) -> None:
        self._broadcast_output()  # the clients there have the lines the newcomer's welcome ends with
        peer = self._peers.add(sock, pid)
        peer.outbox += self._so_far.welcome()

    def _broadcast_queue(self) -> None:
        """What the run published since the last turn, to every client: the steps as rows of one
        record (one encode a turn, not one a step), each other record after the steps before it.
        A step costs no work but an append with no client: the training thread needs the GIL."""
        rows: list[list[Any]] = []
        queue, fold, clients = self._queue, self._so_far.step, len(self._peers) > 0  # no client joins meanwhile
        while queue:
            item = queue.popleft()
            if isinstance(item, StepRecord):
                fold(item)
                if clients:
                    rows.append(item.row())
                continue
            if rows:
                self._send({"kind": "steps", "rows": rows})
                rows = []
            record = self._so_far.record(*item)
            self._admission.answered(record)
            self._send(record)
        if rows:
            self._send({"kind": "steps", "rows": rows})

    def _send(self, record: dict[str, Any]) -> None:
        try:
            line = encode(record)
        except (TypeError, ValueError):  # a step's NaN (another rank's loss) or a value JSON has no form for
            line = encode(clean(record))  # cleaned only if it fails to encode: a walk a step
        self._peers.send(line)

    def _broadcast_output(self) -> None:
        record = self._printed.read(clients=bool(self._peers))
        if record is not None:
            self._peers.send(encode(record))


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
