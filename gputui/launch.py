"""Run a user's training script as `__main__`, the way `python SCRIPT ARGS...` would.

The script sees its own ARGS in sys.argv and its folder first on sys.path. Whatever goes wrong
comes back as an exit code and a short report without gputui's own frames: the script's
traceback is the user's business, ours is noise.
"""

from __future__ import annotations

import builtins
import contextlib
import os
import sys
import traceback
import types
from collections.abc import Callable, Iterator
from typing import Any, TextIO

from .engine.result import FitError, SettingsError  # no torch: result.py holds plain dataclasses
from .telemetry.describe import diagnosis_text

_HIDDEN = (
    os.path.dirname(os.path.abspath(__file__)) + os.sep,
    os.path.join("torch", "nn", "modules", "module.py"),
)


class ScriptNotFound(Exception):
    """The script path does not name a readable Python file."""


def check_script(path: str) -> None:
    if not os.path.exists(path):
        raise ScriptNotFound(f"no such script: {path}")
    if os.path.isdir(path):
        raise ScriptNotFound(f"{path} is a directory, not a Python script")
    if not os.access(path, os.R_OK):
        raise ScriptNotFound(f"cannot read {path}: permission denied")


def _hidden(filename: str) -> bool:
    return any(filename.startswith(h) or filename.endswith(h) for h in _HIDDEN)


def user_traceback(exc: BaseException) -> str:
    """The traceback with gputui's and torch's module-call frames left out."""
    te = traceback.TracebackException.from_exception(exc)
    pending = [te]
    while pending:
        t = pending.pop()
        t.stack = traceback.StackSummary.from_list([f for f in t.stack if not _hidden(f.filename)])
        pending.extend(x for x in (t.__cause__, t.__context__) if x is not None)
    return "".join(te.format())


class _Tee:
    """A stream that passes everything through and shows the text to the loss parser too (and,
    headless, to the hub's output, which attach clients read)."""

    def __init__(self, stream: TextIO, feeds: tuple[Callable[[str], None], ...]) -> None:
        self._stream, self._feeds = stream, feeds

    def write(self, text: str) -> int:
        written = self._stream.write(text)
        for feed in self._feeds:
            try:
                feed(text)
            except Exception:
                pass
        return written

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding, flush...: the real stream's
        return getattr(self._stream, name)


@contextlib.contextmanager
def _observed(hub: Any, output: Callable[[str], None] | None) -> Iterator[Any]:
    """The zero-change observer around the script (a fit() inside takes over from it)."""
    from .engine.observe import Observer
    from .telemetry.lossparse import LossParser

    observer = Observer(hub)
    parser = LossParser(observer.printed)
    feeds = (parser.feed,) if output is None else (parser.feed, output)
    streams = sys.stdout, sys.stderr
    tees = _Tee(streams[0], feeds), _Tee(streams[1], feeds)
    sys.stdout, sys.stderr = tees
    try:
        with observer.installed():
            yield observer
    finally:
        # Only where still ours: a script that outlives the TUI (finishing a save after a quit) must
        # not put back the app's print capture over the terminal's streams the app restored.
        if sys.stdout is tees[0]:
            sys.stdout = streams[0]
        if sys.stderr is tees[1]:
            sys.stderr = streams[1]


def _run_main(path: str) -> None:
    """Execute the file as `python path` does: in a fresh `__main__` (classes defined there pickle
    as `__main__.X`), with `__file__` absolute and `sys.argv[0]` left as given. runpy.run_path
    would make argv[0] the path it is handed, so an absolute `__file__` would leak into argv."""
    file = os.path.abspath(path)
    with open(file, "rb") as source:  # bytes: compile() honours the file's encoding declaration
        code = compile(source.read(), file, "exec", dont_inherit=True)
    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=file, __cached__=None, __builtins__=builtins)
    saved = sys.modules.get("__main__")
    sys.modules["__main__"] = main
    try:
        exec(code, main.__dict__)
    finally:
        if saved is not None:
            sys.modules["__main__"] = saved


def run_script(
    path: str,
    args: list[str],
    *,
    err: TextIO | None = None,
    observe: Any = None,
    output: Callable[[str], None] | None = None,
) -> int:
    """Run `path` as __main__ with `args`; returns the exit code `python path args` would give.

    With `observe` (the hub), a script running its own loop is watched (engine/observe.py), and
    an OOM that ends it is diagnosed before its traceback; `output` then also gets what the script
    writes to sys.stdout and sys.stderr, through the observer's tee (headless: the hub's output,
    for attach; the TUI captures the streams itself)."""
    err = err or sys.stderr
    check_script(path)
    name = os.path.basename(path)
    observing = contextlib.ExitStack()
    # Installed before the script's folder goes on sys.path: a models.py or utils.py there must
    # not shadow what torch imports (the script itself then sees what python would show it).
    try:
        observer = observing.enter_context(_observed(observe, output)) if observe is not None else None
    except KeyboardInterrupt:  # a Ctrl-C while torch loads, before the script began
        err.write(f"\ngputui: {name} interrupted before it started\n")
        return 130
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    sys.argv = [path, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    failure: str | None = None
    try:
        _run_main(path)
        return 0
    except SystemExit as exc:
        if exc.code is None or exc.code == 0:
            return 0
        failure = f"exit code {exc.code}"
        if isinstance(exc.code, int):
            return exc.code
        err.write(f"{exc.code}\n")
        return 1
    except KeyboardInterrupt:
        failure = "interrupted"
        err.write(f"\ngputui: {name} interrupted\n")
        return 130
    except (FitError, SettingsError) as exc:
        failure = str(exc)
        err.write(f"gputui: error: {exc}\n")
        for note in getattr(exc, "__notes__", ()):  # what gputui could not undo or end after it
            err.write(f"  {note}\n")
        return 1
    except SyntaxError as exc:
        where = f"{exc.filename}:{exc.lineno}" if exc.lineno else exc.filename
        failure = f"syntax error at {where}: {exc.msg}"
        err.write(f"gputui: {name} has a syntax error at {where}: {exc.msg}\n")
        return 1
    except BaseException as exc:
        failure = f"{type(exc).__name__}: {exc}"
        err.write(user_traceback(exc))
        if observer is not None and observer.is_oom(exc):  # the failed step's tensors are still alive
            err.write(diagnosis_text(observer.diagnose(exc)))
        err.write(f"gputui: {name} failed: {type(exc).__name__}: {exc}\n")
        return 1
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
        observing.close()
        if observer is not None:
            observer.finish(failure)
        if observe is not None:
            observe.finish()  # the run fit or a Trainer started ends with the script


def detach_from_terminal() -> None:
    """The terminal is gone: point stdin, stdout and stderr at /dev/null so writes cannot fail.

    What the script prints from now on is lost, as under nohup without a log; the metrics file
    and the attach socket still carry everything gputui records."""
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)


def survive_hangup() -> None:
    """Headless runs go on when their terminal closes (SIGHUP), as under nohup."""
    import signal

    signal.signal(signal.SIGHUP, lambda signum, frame: detach_from_terminal())
