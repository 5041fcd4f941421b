"""A save in progress holds back whatever would stop the process at once, until its file is renamed.

"Nothing is lost": a second Ctrl-C, a second SIGTERM or a forced quit that landed mid-save would
abort it, and a process that then exits would leave the temporary file behind and no file.
In the main thread the save holds SIGINT and SIGTERM itself. The TUI runs the script in another
thread, which the runner stops by raising an exception there: it asks `interrupt()`, which
waits for that thread's saves, and it never exits the process while any save runs.
No torch, no textual: the engine and the TUI both use it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

_HELD = (signal.SIGINT, signal.SIGTERM)

# Reentrant: the runner's signal handler calls interrupt() in the main thread, which may be
# inside wait_for_saves() at that moment.
_changed = threading.Condition(threading.RLock())
_saving: dict[int, list[str]] = {}  # thread id -> the paths it is saving (saves nest)
_pending: dict[int, Any] = {}  # thread id -> what to raise in it once its saves end


@contextlib.contextmanager
def saving(path: str) -> Iterator[None]:
    """Mark a save of `path` in progress in this thread; what would stop it at once waits for its end."""
    me = threading.get_ident()
    with _changed:
        _saving.setdefault(me, []).append(path)
    try:
        with _signals_held() if threading.current_thread() is threading.main_thread() else contextlib.nullcontext():
            yield
    finally:
        with _changed:
            _saving[me].remove(path)
            pending = None
            if not _saving[me]:
                del _saving[me]
                pending = _pending.pop(me, None)
            _changed.notify_all()
        if pending is not None:
            raise pending  # right after the rename, as a held signal acts


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM wait until the save ends, then act as they would have.

    A SIGTERM's default action kills without running any cleanup: mid-save it would leave the
    temporary file behind and the save undone."""
    previous = {sig: signal.getsignal(sig) for sig in _HELD}
    if None in previous.values():  # a handler installed outside Python could not be put back
        yield
        return
    caught: list[int] = []
    for sig in _HELD:
        signal.signal(sig, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for signum in dict.fromkeys(caught):
            signal.raise_signal(signum)


def interrupt(thread: threading.Thread, exc: Any) -> None:
    """Raise `exc` in `thread`, as a signal does in the main thread: at its next bytecode, or,
    while it is saving, right after its last save ends (in that thread)."""
    with _changed:  # held: the thread cannot start a save between the check and the raise
        if thread.ident in _saving:
            _pending.setdefault(thread.ident, exc)
        else:
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident or 0), ctypes.py_object(exc))


def wait_for_saves(announce: Callable[[str], None]) -> None:
    """Return once no thread is saving; `announce(path)` once for each save waited for."""
    with _changed:
        _wait(announce)


def exit_after_saves(code: int, announce: Callable[[str], None]) -> NoReturn:
    """os._exit(code) once no thread is saving; holding the lock, so none can start in between."""
    with _changed:
        _wait(announce)
        os._exit(code)


def _wait(announce: Callable[[str], None]) -> None:
    announced: set[str] = set()
    while _saving:
        for path in [p for paths in _saving.values() for p in paths if p not in announced]:
            announced.add(path)
            announce(path)
        _changed.wait()


def notice(line: str) -> None:
    """A line to stderr from a signal handler, never raising: a stderr that is gone (a pipe whose reader
    a Ctrl-C ended, `| tee` say, or a hung-up terminal), or one the handler interrupted a write to (a
    write blocked on a full pipe or a terminal held by Ctrl-S runs the handler with the stream's lock
    held: Python says "reentrant call"), must not turn the stop it announces into a crash of whatever
    the handler interrupted. The line is lost then; the stop is not."""
    # OSError, ValueError: closed; RuntimeError: reentrant; AttributeError: None (a process with no stderr)
    with contextlib.suppress(OSError, ValueError, RuntimeError, AttributeError):
        sys.stderr.write(line)


def ours(handler: Any) -> Any:
    """`handler`, marked as gputui's stop handler (SIGINT, SIGTERM): a child forked while it is installed
    (a DataLoader worker) gets Python's own back (_forked)."""
    handler.gputui_stop = True
    return handler


def _forked() -> None:
    """In a forked child: a Ctrl-C to the process group or a terminate() reaches it too, and gputui's
    handler there would print "finishing the current step" once a worker and leave SIGTERM a flag. The
    child takes them as it would without gputui: SIGINT raises KeyboardInterrupt (a worker's cue that its
    parent stops), SIGTERM ends it."""
    for sig, default in ((signal.SIGINT, signal.default_int_handler), (signal.SIGTERM, signal.SIG_DFL)):
        if getattr(signal.getsignal(sig), "gputui_stop", False):
            signal.signal(sig, default)


os.register_at_fork(after_in_child=_forked)
