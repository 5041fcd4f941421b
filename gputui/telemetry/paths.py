"""Where training processes publish their sockets, and which of those are alive.

`$XDG_RUNTIME_DIR/gputui/<pid>.sock` (a per-user tmpfs the login session owns), else a 0700
folder of the user's under the temp dir. A folder that is not ours and private is refused:
another user could otherwise read the telemetry or plant a socket.
"""

from __future__ import annotations

import os
import socket
import stat
import tempfile
from dataclasses import dataclass


class UnsafeDirectory(Exception):
    """The socket folder exists but belongs to someone else or is open to others."""


def socket_dir() -> str:
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return os.path.join(runtime, "gputui")
    return os.path.join(tempfile.gettempdir(), f"gputui-{os.getuid()}")


def private_dir() -> str:
    """The socket folder, created 0700 if missing; UnsafeDirectory if it is not private and ours."""
    path = socket_dir()
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafeDirectory(f"{path} is not a directory")
    if info.st_uid != os.getuid():
        raise UnsafeDirectory(f"{path} belongs to another user (uid {info.st_uid})")
    if info.st_mode & 0o077:
        raise UnsafeDirectory(f"{path} is open to other users (mode {stat.S_IMODE(info.st_mode):o}); "
                              "chmod 700 it or remove it")
    return path


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

    A socket is stale when its process is gone (killed with SIGKILL: no chance to remove it)."""
    folder = socket_dir()
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
