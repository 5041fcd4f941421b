"""Atomic saves: what a quit or a Ctrl-C asks to keep is written whole or not at all."""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import stat
from typing import IO, Any

import torch

from .. import interrupts
from ..telemetry.hub import current
from ..telemetry.paths import pid_alive

TEMP_SUFFIX = ".gputui-tmp"
"""Temporary files are `.NAME.HOST.PID.TOKEN.gputui-tmp` beside the file: a later save to the same
path knows whose each one is, and removes those of processes that died mid-save (a SIGKILL, the OOM
killer) instead of leaving a checkpoint-sized file behind each time."""


def save(obj: Any, path: str | os.PathLike[str] | IO[bytes]) -> None:
    """torch.save into a temporary file beside `path`, fsync it, then rename it over `path`.

    A crash or a full disk mid-save leaves the previous file intact; a Ctrl-C, a SIGTERM or a
    forced quit of the TUI during the save takes effect once the new file is in place
    (interrupts.py). A symlink is written through (its target replaced, the link kept); the file
    keeps the mode of the one it replaces (a new one gets `open()`'s: 0666 & ~umask). An error names
    `path`, not the temporary file. A file object (io.BytesIO) is written as torch.save writes it.
    """
    if not isinstance(path, (str, os.PathLike)):
        torch.save(obj, path)
        return
    path = os.fspath(path)
    try:
        _save(obj, path)
    except OSError as exc:  # the temporary file's name in it would mislead: the user gave `path`
        raise type(exc)(exc.errno, exc.strerror, path) from None


def _save(obj: Any, path: str) -> None:
    target = os.path.realpath(path)  # a link's target: renaming over the link would leave it stale
    folder, name = os.path.split(target)
    _remove_orphans(folder, name)  # first: a dead save's space may be what this one needs
    tmp = os.path.join(folder, f".{name}.{_host()}.{os.getpid()}.{secrets.token_hex(4)}{TEMP_SUFFIX}")
    with interrupts.saving(path):
        f = open(tmp, "xb")  # "x": O_EXCL, and the mode a plain torch.save would give a new file
        try:
            with f:
                with contextlib.suppress(FileNotFoundError):
                    os.fchmod(f.fileno(), stat.S_IMODE(os.stat(target).st_mode))  # a 0600 checkpoint stays 0600
                torch.save(obj, f)
                f.flush()
                os.fsync(f.fileno())
                size = f.tell()
            os.replace(tmp, target)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    hub = current()
    if hub is not None:  # the exit summary lists what was saved
        hub.note_saved(path, size)


def _host() -> str:
    """In a temporary file's name: a folder shared between machines or containers holds other hosts'
    files, whose pids mean nothing here."""
    return socket.gethostname().replace(os.sep, "_")


def _remove_orphans(folder: str, name: str) -> None:
    """Remove the temporary files of saves to `folder/name` by processes of this host that are gone.
    A live process's (this one's too: another thread may be saving) is never touched; a pid reused
    since keeps its file until that process ends, which errs on the side of keeping."""
    prefix = f".{name}."
    host = _host()
    try:
        entries = os.listdir(folder)
    except OSError:
        return  # the save itself will say what is wrong with the folder
    for entry in entries:
        if not (entry.startswith(prefix) and entry.endswith(TEMP_SUFFIX)):
            continue
        owner, _, _ = entry[len(prefix) : -len(TEMP_SUFFIX)].rpartition(".")
        their_host, _, pid = owner.rpartition(".")
        if their_host != host or not pid.isdigit() or int(pid) == os.getpid() or pid_alive(int(pid)):
            continue
        with contextlib.suppress(OSError):  # another save may be removing it at the same moment
            os.unlink(os.path.join(folder, entry))
