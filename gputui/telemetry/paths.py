"""Where training processes publish their sockets, and which of those are alive.

`$XDG_RUNTIME_DIR/gputui/<pid>.sock` (a per-user tmpfs the login session owns), else a 0700
folder of the user's under the temp dir. A folder that is not ours and private is refused, by
the job and by every client alike (check_private): another user could otherwise read the
telemetry, or plant a folder and a fake job that clients would list, steer and print.
"""

from __future__ import annotations

import os
import socket
import stat
import tempfile
from dataclasses import dataclass


class UnsafeDirectory(Exception):
    """The socket folder (or a socket) exists but is a link, belongs to someone else or is open to others."""


class ForeignPeer(ConnectionError):
    """The process at the other end of a socket runs as another user."""


def socket_dir() -> str:
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return os.path.join(runtime, "gputui")
    return os.path.join(tempfile.gettempdir(), f"gputui-{os.getuid()}")


def check_private(path: str) -> None:
    """UnsafeDirectory unless `path` is a folder (not a link) of ours that no one else may enter.

    The one check the server makes before it binds and every client makes before it trusts what
    the folder holds: anyone may create `$TMPDIR/gputui-<uid>` first and serve fake jobs from it."""
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        raise UnsafeDirectory(f"{path} is a symbolic link, not a folder: not trusted; remove it")
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafeDirectory(f"{path} is not a folder: not trusted; remove it")
    if info.st_uid != os.getuid():
        raise UnsafeDirectory(
            f"{path} belongs to another user (uid {info.st_uid}): not trusted; remove it "
            "or set XDG_RUNTIME_DIR to a private folder"
        )
    if info.st_mode & 0o077:
        raise UnsafeDirectory(
            f"{path} is open to other users (mode {stat.S_IMODE(info.st_mode):o}): not trusted; "
            "chmod 700 it or remove it"
        )


def private_dir() -> str:
    """The socket folder, created 0700 if missing; UnsafeDirectory if it is not private and ours."""
    path = socket_dir()
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    check_private(path)
    return path


def existing_dir() -> str | None:
    """The socket folder if it exists (None: no jobs), checked; a client never creates it."""
    path = socket_dir()
    try:
        check_private(path)
    except FileNotFoundError:
        return None
    return path


def check_socket(path: str) -> None:
    """UnsafeDirectory unless `path` is a socket of ours in a private folder of ours (an explicit
    `gputui attach PATH`: the same trust as the folder the jobs list comes from)."""
    real = os.path.realpath(path)
    info = os.stat(real)  # first: a name that is no socket (a typo, the script's name) is said as such
    if not stat.S_ISSOCK(info.st_mode):
        raise UnsafeDirectory(f"{path} is not a socket: name a job by its PID or socket (gputui jobs lists them)")
    check_private(os.path.dirname(real))
    if info.st_uid != os.getuid():
        raise UnsafeDirectory(f"{path} belongs to another user (uid {info.st_uid}): not trusted")


def socket_path(pid: int | None = None) -> str:
    return os.path.join(socket_dir(), f"{os.getpid() if pid is None else pid}.sock")


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, but someone else's
        return True
    return True


@dataclass(frozen=True)
class Job:
    pid: int
    path: str


def find_jobs() -> list[Job]:
    """The sockets in the folder whose process is alive; stale ones are removed.

    A socket is stale when its process is gone (killed with SIGKILL: no chance to remove it).
    UnsafeDirectory if the folder is not ours and private."""
    folder = existing_dir()
    if folder is None:
        return []
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return []
    jobs = []
    for name in sorted(names):
        stem, dot, ext = name.partition(".")
        if ext != "sock" or not stem.isdigit():
            continue
        path = os.path.join(folder, name)
        if pid_alive(int(stem)):
            jobs.append(Job(int(stem), path))
        else:
            try:
                os.unlink(path)
            except OSError:
                pass
    return jobs


def peer_uid(sock: socket.socket) -> tuple[int, int] | None:
    """(pid, uid) of the process at the other end of a Unix socket, where the OS tells (Linux)."""
    option = getattr(socket, "SO_PEERCRED", None)
    if option is None:
        return None
    import struct

    pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, option, struct.calcsize("3i")))
    return pid, uid


def check_peer(sock: socket.socket) -> None:
    """ForeignPeer if the process at the other end runs as another user (where the OS tells)."""
    cred = peer_uid(sock)
    if cred is not None and cred[1] != os.getuid():
        raise ForeignPeer(
            f"the process at the other end (pid {cred[0]}) runs as another user (uid {cred[1]}): not trusted"
        )
