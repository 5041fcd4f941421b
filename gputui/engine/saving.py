"""Atomic saves: what a quit or a Ctrl-C asks to keep is written whole or not at all."""

from __future__ import annotations

import os
import secrets
from typing import Any

import torch

from .. import interrupts


def save(obj: Any, path: str | os.PathLike[str]) -> None:
    """torch.save into a temporary file beside `path`, fsync it, then rename it over `path`.

    A crash or a full disk mid-save leaves the previous file intact; a Ctrl-C, a SIGTERM or a
    forced quit of the TUI during the save takes effect once the new file is in place
    (interrupts.py).
    """
    path = os.fspath(path)
    tmp = os.path.join(os.path.dirname(os.path.abspath(path)), f".{os.path.basename(path)}.{secrets.token_hex(4)}.tmp")
    with interrupts.saving(path):
        # "x": O_EXCL, and the mode a plain torch.save would give the file (0666 & ~umask), unlike mkstemp.
        f = open(tmp, "xb")
        try:
            with f:
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
