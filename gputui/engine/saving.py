"""Atomic saves: what a quit or a Ctrl-C asks to keep is written whole or not at all."""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import threading
from typing import Any, Iterator

import torch

_DEFERRED = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """SIGINT and SIGTERM wait until the file is whole and renamed, then act as they would have.

    A SIGTERM's default action kills without running any cleanup: mid-save it would leave the
    temporary file behind and the save undone. Only the main thread can hold signals back;
    elsewhere an exception still removes the temporary file."""
    previous = {sig: signal.getsignal(sig) for sig in _DEFERRED}
    if threading.current_thread() is not threading.main_thread() or None in previous.values():
        yield  # a handler installed outside Python (getsignal: None) could not be put back
        return
    caught: list[int] = []
    for sig in _DEFERRED:
        signal.signal(sig, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for signum in dict.fromkeys(caught):
            signal.raise_signal(signum)


def save(obj: Any, path: str | os.PathLike[str]) -> None:
    """torch.save into a temporary file beside `path`, fsync it, then rename it over `path`.

    A crash or a full disk mid-save leaves the previous file intact; a Ctrl-C or SIGTERM during
    the save takes effect once the new file is in place.
    """
    path = os.fspath(path)
    tmp = os.path.join(os.path.dirname(os.path.abspath(path)), f".{os.path.basename(path)}.{secrets.token_hex(4)}.tmp")
    with _signals_deferred():
        # os.open, not mkstemp: the file gets the mode a plain torch.save would give it (0666 & ~umask).
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(obj, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
