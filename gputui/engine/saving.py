"""Atomic saves: what a quit or a Ctrl-C asks to keep is written whole or not at all."""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch


def save(obj: Any, path: str | os.PathLike[str]) -> None:
    """torch.save into a temporary file beside `path`, fsync it, then rename it over `path`.

    A crash, a second Ctrl-C or a full disk mid-save leaves the previous file intact.
    """
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=folder)
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
