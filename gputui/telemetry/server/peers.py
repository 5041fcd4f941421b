"""The connections a server serves, and the fan-out of records into them with back-pressure.

A record is serialized once and appended to every client's buffer; the server thread writes what
each socket takes and never blocks. A client that falls more than MAX_PENDING behind is dropped (it
missed what it missed; nothing is resent), and past MAX_BUFFERED for all clients together the one
furthest behind goes first, so stuck or hostile clients cost the job a bounded few megabytes.
"""

from __future__ import annotations

import selectors
import socket
from collections.abc import Iterator
from dataclasses import dataclass, field

MAX_PENDING = 8 * 2**20
"""Bytes waiting for one client before it counts as too slow and is dropped."""

MAX_BUFFERED = 32 * 2**20
"""Bytes waiting for all clients together; past it the client furthest behind is dropped first."""


@dataclass
class Peer:
    sock: socket.socket
    pid: int | None
    control: bool = False
    inbox: bytearray = field(default_factory=bytearray)
    outbox: bytearray = field(default_factory=bytearray)
    errors: int = 0
    waiting: set[int] = field(default_factory=set)  # its requests the job has not answered yet


class Peers:
    """The clients connected, each registered with the server thread's selector (its Peer as the key's
    data): for reading always, for writing while its outbox holds something."""

    def __init__(self, selector: selectors.BaseSelector) -> None:
        self._selector = selector
        self._peers: dict[socket.socket, Peer] = {}

    def __len__(self) -> int:
        return len(self._peers)

    def __iter__(self) -> Iterator[Peer]:
        """A copy: the loop may drop the peer it is at."""
        return iter(list(self._peers.values()))

    def __contains__(self, peer: Peer) -> bool:
        return peer.sock in self._peers

    def add(self, sock: socket.socket, pid: int | None) -> Peer:
        sock.setblocking(False)  # an adopted one is still blocking
        peer = Peer(sock, pid)
        self._peers[sock] = peer
        self._selector.register(sock, selectors.EVENT_READ, peer)
        return peer

    def send(self, line: bytes) -> None:
        """One line to every client (written as their sockets take it)."""
        for peer in self._peers.values():
            peer.outbox += line

    def flush_all(self) -> None:
        """Write what each socket takes; then, past MAX_BUFFERED for all clients, drop the ones furthest
        behind until under it."""
        for peer in self:
            if peer.outbox:
                self.flush(peer)
        total = sum(len(peer.outbox) for peer in self._peers.values())
        for peer in sorted(self._peers.values(), key=lambda p: len(p.outbox), reverse=True):
            if total <= MAX_BUFFERED:
                return
            total -= len(peer.outbox)
            self.drop(peer)

    def flush(self, peer: Peer, final: bool = False) -> None:
        """Write what the peer's socket takes now; past MAX_PENDING left (unless `final`: the server is
        closing), drop it."""
        while peer.outbox:
            try:
                sent = peer.sock.send(peer.outbox[:262144])
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                self.drop(peer)
                return
            del peer.outbox[:sent]
        if len(peer.outbox) > MAX_PENDING and not final:
            self.drop(peer)  # too slow: it would hold ever more memory of ours
            return
        if peer in self:
            wanted = selectors.EVENT_READ | (selectors.EVENT_WRITE if peer.outbox else 0)
            if self._selector.get_key(peer.sock).events != wanted:
                self._selector.modify(peer.sock, wanted, peer)

    def drop(self, peer: Peer) -> None:
        if self._peers.pop(peer.sock, None) is None:
            return
        try:
            self._selector.unregister(peer.sock)
        except (KeyError, ValueError):
            pass
        peer.sock.close()
