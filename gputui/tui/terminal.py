"""Keep the screen clean while the TUI owns the terminal.

Python-level prints are captured by Textual, but C and C++ code (NCCL, cuDNN, a library's own
logging) write to file descriptors 1 and 2 directly and would scribble over the screen. While
the app runs, those descriptors point into a pipe whose text joins the script's log, and
Textual draws on a duplicate of the real terminal.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from typing import Callable, Iterator


@contextlib.contextmanager
def guarded_output(sink: Callable[[str], None]) -> Iterator[None]:
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    saved_out, saved_err = os.dup(1), os.dup(2)
    read_end, write_end = os.pipe()
    os.dup2(write_end, 1)
    os.dup2(write_end, 2)
    os.close(write_end)
    originals = sys.__stdout__, sys.__stderr__
    # Textual reads these when the app is built and when its driver starts: the real terminal.
    sys.__stdout__ = open(saved_out, "w", closefd=False)  # type: ignore[misc]
    sys.__stderr__ = open(saved_err, "w", closefd=False)  # type: ignore[misc]

    def pump() -> None:
        with open(read_end, "r", encoding="utf-8", errors="replace", closefd=True) as pipe:
            for line in pipe:
                sink(line)

    reader = threading.Thread(target=pump, name="gputui-output", daemon=True)
    reader.start()
    try:
        yield
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os.dup2(saved_out, 1)  # the pipe's last write ends close here: the reader sees EOF
        os.dup2(saved_err, 2)
        sys.__stdout__, sys.__stderr__ = originals  # type: ignore[misc]
        os.close(saved_out)
        os.close(saved_err)
        reader.join(timeout=1)
