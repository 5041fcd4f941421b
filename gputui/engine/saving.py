"""Atomic saves: what a quit or a Ctrl-C asks to keep is written whole or not at all."""

from __future__ import annotations

import os
import secrets
from typing import Any

import torch


def save(obj: Any, path: str | os.PathLike[str]) -> None:
    """torch.save into a temporary file beside `path`, fsync it, then rename it over `path`.

    A crash, a second Ctrl-C or a full disk mid-save leaves the previous file intact.
    """
    path = os.fspath(path)
    tmp = os.path.join(os.path.dirname(os.path.abspath(path)), f".{os.path.basename(path)}.{secrets.token_hex(4)}.tmp")
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
