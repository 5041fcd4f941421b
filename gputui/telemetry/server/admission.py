"""What a client may ask of the job: its lines read and checked, a hello (to watch or to steer), and
control requests admitted within limits.

Nothing a client sends is evaluated: every line goes through protocol.parse_client. Only a connection
that asked for control may steer, and only a few requests at a time, as each may cost the training
thread a step's worth of work. Every request is answered at once: an ack with the job's request id
(the event that applies it carries that id), or an error saying why not.
"""

from __future__ import annotations

from typing import Any

from ..controls import Controls
from ..protocol import MAX_CLIENT_LINE, ProtocolError, encode, parse_client
from .peers import Peer, Peers

MAX_CONTROLS_PER_CLIENT = 4
"""Requests one connection may have waiting (queued, or applied but not yet answered)."""

MAX_CONTROLS = 16
"""Requests all connections together may have waiting: a `top_tensors` costs ~0.2 s of training."""

MAX_ERRORS = 100
"""Invalid lines a connection may send: past it, a client that only sends garbage is dropped."""


class Admission:
    def __init__(self, controls: Controls, peers: Peers) -> None:
        self.controls, self.peers = controls, peers
        self.waiting: set[int] = set()  # request ids, from every connection, not answered yet

    def read(self, peer: Peer) -> None:
        """What the peer sent, line by line; at the end of its stream it is dropped, and told why and
        dropped for a line longer than MAX_CLIENT_LINE."""
        try:
            data = peer.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self.peers.drop(peer)
            return
        peer.inbox += data
        while b"\n" in peer.inbox:
            line, _, rest = peer.inbox.partition(b"\n")
            peer.inbox = bytearray(rest)
            self._handle(peer, bytes(line))
            if peer not in self.peers:
                return
        if len(peer.inbox) > MAX_CLIENT_LINE:
            peer.outbox += encode({"kind": "error", "reason": f"line longer than {MAX_CLIENT_LINE} bytes"})
            self.peers.flush(peer, final=True)
            self.peers.drop(peer)

    def _handle(self, peer: Peer, line: bytes) -> None:
        try:
            message = parse_client(line)
        except ProtocolError as exc:
            peer.errors += 1
            peer.outbox += encode({"kind": "error", "reason": str(exc)})
            if peer.errors > MAX_ERRORS:
                self.peers.drop(peer)
            return
        if message["kind"] == "hello":
            peer.control = message["control"]
            peer.outbox += encode({"kind": "ack", "hello": True, "control": peer.control})
            return
        ident = message["id"]
        if not peer.control:
            self._refuse(peer, ident, "watch-only connection: attach with --control to steer")
            return
        if len(peer.waiting) >= MAX_CONTROLS_PER_CLIENT or len(self.waiting) >= MAX_CONTROLS:
            mine = len(peer.waiting) >= MAX_CONTROLS_PER_CLIENT
            self._refuse(
                peer,
                ident,
                f"{len(peer.waiting) if mine else len(self.waiting)} requests from "
                f"{'this connection' if mine else 'attached clients'} are waiting for the job to apply them "
                "(at its next step boundary): send this one when they are answered",
            )
            return
        try:
            control = self.controls.request(
                message["action"], message["value"], source=f"attach pid {peer.pid}" if peer.pid else "attach"
            )
        except ValueError as exc:
            self._refuse(peer, ident, str(exc))
            return
        peer.waiting.add(control.id)
        self.waiting.add(control.id)
        peer.outbox += encode({"kind": "ack", "id": ident, "request_id": control.id})

    @staticmethod
    def _refuse(peer: Peer, ident: int, reason: str) -> None:
        peer.outbox += encode({"kind": "error", "id": ident, "reason": reason})

    def answered(self, record: dict[str, Any]) -> None:
        """The requests a record the run published answers: an event, its request; a run's start or
        end, every request left (a stop has no answering event)."""
        if record["kind"] in ("start", "end"):
            ids = set(self.waiting)
        elif record.get("request_id") in self.waiting:
            ids = {record["request_id"]}
        else:
            return
        for peer in self.peers:
            peer.waiting -= ids
        self.waiting -= ids
