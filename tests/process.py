"""The processes tests start (a job, a script, a CLI command, torchrun): one way to start them, to wait for
what they do, and to end them with whatever they started. A pytest plugin (tests/conftest.py loads it).

Each process starts in a session of its own, so ending it reaches its process group; what it started in
sessions of their own (torchrun's ranks) is found by walking its children before the kill. A wait polls a
condition (`wait_until`) with a deadline: never a fixed sleep, never a hang.
"""

from __future__ import annotations

import contextlib
import os
import pty
import re
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import psutil
import pytest

T = TypeVar("T")
K = TypeVar("K", bound="Terminal")


def wait_until(
    condition: Callable[[], T],
    timeout: float = 60.0,
    message: str | Callable[[], str] = "",
    process: subprocess.Popen | None = None,
    every: float = 0.01,
) -> T:
    """Poll `condition()` until it returns something true, and return that. Fails after `timeout` seconds,
    or at once if `process` has ended; `message` (or what it returns) says what was awaited."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if process is not None and process.poll() is not None:
            why = f"the process ended (exit code {process.returncode})"
        elif time.monotonic() > deadline:
            why = f"not within {timeout} s"
        else:
            time.sleep(every)
            continue
        raise AssertionError(f"{why}: {message() if callable(message) else message}")
    return value


def end_tree(pid: int, running: bool = True) -> None:
    """SIGKILL the process group `pid` leads and, if `pid` still `running` (not reaped: its pid is still
    its own), every process under it (collected first: torchrun's ranks run in sessions of their own).
    Reaping stays with whoever started them."""
    tree = []
    if running:
        with contextlib.suppress(psutil.NoSuchProcess):
            tree = [p.pid for p in psutil.Process(pid).children(recursive=True)] + [pid]
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    for each in tree:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(each, signal.SIGKILL)


def run(argv: Iterable[Any], *, timeout: float = 120, input: str | bytes | None = None, **popen: Any):
    """subprocess.run in a session of its own, its output captured as text unless `popen` says otherwise.
    Past `timeout` its whole tree is ended and the test fails with the end of what it wrote."""
    argv = [str(a) for a in argv]
    popen = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True, **popen}
    if input is not None:
        popen["stdin"] = subprocess.PIPE
    with subprocess.Popen(argv, start_new_session=True, **popen) as proc:
        try:
            out, err = proc.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            end_tree(proc.pid)
            out, err = proc.communicate()
            raise AssertionError(f"{argv} still ran after {timeout} s; it wrote: {out!r:.3000} {err!r:.3000}") from None
        except BaseException:
            end_tree(proc.pid)
            raise
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def gputui(*args: Any, **kwargs: Any) -> subprocess.CompletedProcess:
    """`python -m gputui ARGS`, run to its end (`run`'s keywords: env, cwd, timeout, input, ...)."""
    return run([sys.executable, "-m", "gputui", *args], **kwargs)


def python(*args: Any, **kwargs: Any) -> subprocess.CompletedProcess:
    """`python ARGS` (a script, `-c CODE`), run to its end (`run`'s keywords)."""
    return run([sys.executable, *args], **kwargs)


def socket_of(env: dict[str, str], pid: int, timeout: float = 60) -> str:
    """The attach socket a job started with `env` serves (in its XDG_RUNTIME_DIR), once it exists."""
    path = os.path.join(env["XDG_RUNTIME_DIR"], "gputui", f"{pid}.sock")
    wait_until(lambda: os.path.exists(path), timeout, f"the job never served {path}")
    return path


def wait_steps(env: dict[str, str], pid: int, n: int, timeout: float = 60) -> None:
    """Until the job has trained `n` steps: its records, read from its socket as they come."""
    from gputui.telemetry.client import Connection

    with Connection(socket_of(env, pid), timeout=timeout) as conn:
        latest = conn.welcome().latest
        step = 0 if latest is None else latest.step
        while step < n:
            record = conn.read()
            assert record is not None, "the job ended first"
            if record["kind"] == "steps":
                step = record["rows"][-1][1]


def screens(pid: int) -> list[int]:
    """The pids of the screens (`python -m gputui.tui`) that `gputui run` (`pid`) has as children."""
    found = []
    for child in psutil.Process(pid).children():
        with contextlib.suppress(psutil.Error):  # one that just ended
            if "gputui.tui" in " ".join(child.cmdline()):
                found.append(child.pid)
    return found


class Terminal:
    """A command on a pseudo-terminal, as a shell in a terminal runs it (it leads its session and the
    terminal's foreground group). What it draws is read as it comes: an unread terminal blocks its writer."""

    def __init__(self, argv: Iterable[Any], env: dict[str, str], cwd: str | os.PathLike | None = None) -> None:
        argv = [str(a) for a in argv]
        env = {"TERM": "xterm-256color", **env}
        self.pid, self.master = pty.fork()
        if self.pid == 0:  # the child: nothing of pytest may run here, whatever happens
            try:
                if cwd is not None:
                    os.chdir(cwd)
                os.execve(argv[0], argv, env)
            finally:
                os._exit(127)
        self.screen = bytearray()
        self.closed = threading.Event()  # the child side of the terminal closed (EIO), or it was hung up
        self.exited: int | None = None
        self._hung_up = threading.Event()
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()

    def _drain(self) -> None:
        # Polled, not a blocking read: the master is closed only once this has stopped reading it (a close
        # under a blocked read would neither hang up at once nor keep the fd's number from being reused).
        try:
            while not self._hung_up.is_set():
                if select.select([self.master], [], [], 0.02)[0]:
                    if not (chunk := os.read(self.master, 65536)):
                        break
                    self.screen += chunk
        except OSError:  # EIO: the child side closed
            pass
        finally:
            self.closed.set()

    def text(self, tail: int = 6000) -> str:
        """The end of what was drawn, escape sequences made spaces: to search, and for failure messages."""
        return re.sub(r"\x1b\[[0-9;?<>=$]*[A-Za-z]", " ", self.screen[-tail:].decode("utf-8", "replace"))

    def wait_for(self, condition: Callable[[], T], timeout: float = 30, every: float = 0.02) -> T:
        return wait_until(condition, timeout, lambda: f"screen: {self.text(3000)}", every=every)

    def wait_shown(self, *texts: str, timeout: float = 30) -> None:
        """Until every one of `texts` has been drawn (anywhere in what the terminal got: read whole, so
        polled at a slower pace)."""
        self.wait_for(lambda: all(t in self.text(len(self.screen)) for t in texts), timeout, every=0.1)

    def send(self, keys: bytes) -> None:
        os.write(self.master, keys)

    def exit_code(self, timeout: float = 30) -> int:
        """Its exit code, once it has exited (the terminal's child reaped)."""
        if self.exited is None:
            _, status = self.wait_for(lambda: (reaped := os.waitpid(self.pid, os.WNOHANG))[0] and reaped, timeout)
            self.exited = os.waitstatus_to_exitcode(status)
        return self.exited

    def hang_up(self) -> None:
        """The terminal goes away (its window closed): the session gets a SIGHUP, reads and writes fail."""
        if not self._hung_up.is_set():
            self._hung_up.set()
            self._reader.join()
            os.close(self.master)

    def close(self) -> None:
        """Ends it with whatever it started, if it still runs, and reaps it; closes the terminal."""
        running = self.exited is None
        end_tree(self.pid, running=running)  # reaped: what is left of its group
        if running:
            os.waitpid(self.pid, 0)
            self.exited = -signal.SIGKILL
        self.hang_up()


class Processes:
    """What one test starts (`processes` fixture). At its end, whatever still runs is ended, with all it
    started (and the pids `adopt` was given), and reaped."""

    def __init__(self) -> None:
        self.popens: list[subprocess.Popen] = []
        self.terminals: list[Terminal] = []
        self.adopted: list[int] = []

    def start(self, argv: Iterable[Any], **popen: Any) -> subprocess.Popen:
        """subprocess.Popen(argv, **popen) in a session of its own."""
        proc = subprocess.Popen([str(a) for a in argv], start_new_session=True, **popen)
        self.popens.append(proc)
        return proc

    def gputui(self, *args: Any, **popen: Any) -> subprocess.Popen:
        """`python -m gputui ARGS`, started."""
        return self.start([sys.executable, "-m", "gputui", *args], **popen)

    def terminal(
        self, argv: Iterable[Any], env: dict[str, str], cwd: str | os.PathLike | None = None, kind: type[K] = Terminal
    ) -> K:
        """`argv` on a pseudo-terminal of its own: a Terminal, or the `kind` of one a test file adds to."""
        terminal = kind(argv, env, cwd)
        self.terminals.append(terminal)
        return terminal

    def adopt(self, *pids: int) -> None:
        """Processes found along the way (a job's ranks) that must not outlive the test either."""
        self.adopted += pids

    def close(self) -> None:
        for proc in self.popens:
            end_tree(proc.pid, running=proc.poll() is None)
            proc.wait(30)
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                if stream is not None:
                    stream.close()
        for terminal in self.terminals:
            terminal.close()
        for pid in self.adopted:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def processes():
    """Starts a test's processes (Processes); nothing it started outlives the test."""
    started = Processes()
    yield started
    started.close()


@pytest.fixture
def env(tmp_path):
    """The environment of the processes a test starts: a socket folder of the test's own (XDG_RUNTIME_DIR),
    so `gputui jobs` lists only its jobs, and unbuffered output, so what a job prints arrives as it prints."""
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    return {**os.environ, "XDG_RUNTIME_DIR": str(runtime), "PYTHONUNBUFFERED": "1"}
