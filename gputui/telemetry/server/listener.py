"""The socket a job listens on, and who gets in.

Only the owning user can connect: the folder is 0700 and the socket 0600, and the peer's uid is
checked where the OS tells it. The socket is bound and listening under another name, then renamed
into place: a client that finds it can connect (between bind() and listen() it would be refused).
"""

from __future__ import annotations

import os
import socket

from ..paths import find_jobs, peer_uid, private_dir
from ..protocol import encode

BACKLOG = 128
"""Connections the kernel holds until the server thread accepts them (a client waits when full)."""

MAX_ACCEPTS = 64
"""Connections accepted in one turn, so a flood of them cannot starve the records."""

MAX_CLIENTS = 64
"""Connections served at once; one more is told so and closed."""


class Listener:
    def __init__(self, path: str) -> None:
        """Bind and listen at `path`; OSError or UnsafeDirectory if the socket cannot be made safely."""
        private_dir()
        find_jobs()  # removes the sockets of jobs killed with SIGKILL: they could not remove their own
        binding = path + ".binding"
        for stale in (path, binding):  # ours by name: a dead process with our pid left it
            if os.path.lexists(stale):
                os.unlink(stale)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(binding)
            os.chmod(binding, 0o600)
            sock.listen(BACKLOG)
            os.rename(binding, path)
        except BaseException:
            sock.close()
            if os.path.lexists(binding):
                os.unlink(binding)
            raise
        sock.setblocking(False)
        self.sock, self.path = sock, path

    def accept(self, served: int) -> list[tuple[socket.socket, int | None]]:
        """The connections waiting (MAX_ACCEPTS at most), non-blocking, each with its peer's pid where
        the OS tells it; one of another user is closed, one past MAX_CLIENTS (`served` are already)
        told so and closed."""
        accepted: list[tuple[socket.socket, int | None]] = []
        for _ in range(MAX_ACCEPTS):
            try:
                sock, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                break
            except OSError:  # out of file descriptors (the script's own): they wait in the backlog
                break
            cred = peer_uid(sock)
            if cred is not None and cred[1] != os.getuid():
                sock.close()  # another user: the folder's mode should have stopped them already
                continue
            sock.setblocking(False)
            if served + len(accepted) >= MAX_CLIENTS:
                try:
                    sock.send(encode({"kind": "error", "reason": f"the job serves {MAX_CLIENTS} clients already"}))
                except OSError:
                    pass
                sock.close()
                continue
            accepted.append((sock, cred[0] if cred else None))
        return accepted

    def close(self) -> None:
        """Stop listening and remove the socket."""
        self.sock.close()
        try:
            os.unlink(self.path)
        except OSError:
            pass
