"""`gputui run` under its screen: the script trains in a thread of this process, the one the user
started (its pid, socket, output and exit code are a headless run's), and the screen is a child
process on the terminal (`python -m gputui.tui`, runner.py), attached to the run as `gputui attach
--control` would be: _Screen says why. No textual here: this process never draws.

When the terminal goes away (SIGHUP: an SSH session dropped, a tmux window killed; or a hang-up the
screen notices), the screen leaves and the run goes on headless: training goes on, the socket keeps
serving, and the process exits with the script's code when it ends. SIGTERM and SIGINT act as they
do headless: the fit stops after its step, the script finishes (its save runs), the screen leaves;
a second one stops the script at once, or right after a save in progress.
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import socket
import subprocess
import sys
import termios
import threading
import time
from typing import Any

from .. import interrupts
from ..launch import detach_from_terminal, run_script
from ..telemetry.progress import closing_lines
from ..telemetry.sample import Event
from ..telemetry.server import TelemetryServer
from .terminal import Terminal, captured_output

SCRIPT_TAIL = 15
"""Lines of the script's own output printed when the app closes."""


UNWIND_S = 2.0
"""How long a script stopped at once gets to unwind before the process exits without it."""

STOPS: dict[int, str] = {signal.SIGINT: "interrupted", signal.SIGTERM: "terminated"}

SCREEN_GRACE = 5.0
"""Seconds the screen gets to leave (the terminal given back) once the run is over, before it is killed."""

REPORT_CHARS = 65_536
"""The end of a failed script's report that the screen is sent (a traceback, an OOM's diagnosis)."""


class _Terminated(SystemExit):
    """A second SIGTERM, raised in the script's thread: it ends as headless would (code 143)."""

    def __init__(self) -> None:
        super().__init__(128 + signal.SIGTERM)


_Terminated.__name__ = _Terminated.__qualname__ = "SystemExit"  # as fit's end record names it headless


def _announce(path: str) -> None:
    sys.stderr.write(f"gputui: waiting for the save of {path} to finish\n")
    sys.stderr.flush()


class _Screen:
    """The screen of `gputui run`: `python -m gputui.tui` on the terminal, attached to this run through
    one end of a socket pair, with control (no socket folder involved: it works where attach cannot).
    Its frames then cost the training thread nothing: they are drawn in another process, under
    another GIL, on another core; this process only encodes the records it sends."""

    def __init__(self, hub: Any, terminal: Terminal, script: str, refresh: float) -> None:
        self._fd = terminal.fds[1]
        self._tty = _tty_state(self._fd)  # given back as it was, whatever becomes of the screen
        ours, theirs = socket.socketpair()
        # Started with SIGINT blocked (__main__.py then ignores it and unblocks): a Ctrl-C while the
        # terminal is still cooked reaches the whole group, and must not kill a screen not yet past
        # Python's start. Here it waits, pending, until the screen is made, then stops the run.
        held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "gputui.tui", str(theirs.fileno()), str(os.getpid()), script, f"{refresh:g}"],
                stdin=terminal.fds[0],
                stdout=terminal.fds[1],
                stderr=terminal.fds[2],
                pass_fds=[theirs.fileno()],
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
        self.server = TelemetryServer(hub)
        self.server.adopt(ours, self.process.pid)
        self.server.start(listen=False)
        self.deadline: float | None = None  # told to leave at once: killed if still there then
        self.gone = False

    def signal(self, signum: int) -> None:
        """Only system calls: safe in a signal handler. A stopped screen (SIGSTOP) is woken to take it;
        one that has left is not signalled (its pid may be another process's by now)."""
        if self.gone:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.process.pid, signum)
            os.kill(self.process.pid, signal.SIGCONT)

    def leave(self, signum: int) -> None:
        """It leaves at once (SIGTERM: a second stop signal; SIGHUP: the terminal is gone), and is killed
        if it has not in SCREEN_GRACE s."""
        self.signal(signum)
        self.deadline = time.monotonic() + SCREEN_GRACE

    def signalled(self, step: int, reason: str) -> None:
        """The run was signalled: the screen leaves once the script has ended. An event, not a signal to
        the screen: it is in the welcome of a screen still starting (a signal would kill it then)."""
        self.server.on_event(Event("signalled", step, {"reason": reason}))

    def script_ended(self, step: int, code: int, report: str) -> None:
        """Tell the screen (only it: not the metrics file, not attach clients) how the script ended."""
        lines = report[-REPORT_CHARS:].splitlines()  # as lines: a string's newlines are stripped on the way
        self.server.on_event(Event("script_ended", step, {"code": code, "report": lines}))

    def wait(self) -> int:
        """The screen's exit code once it has left, as a shell says it (128 + N when signal N ended it);
        signal handlers run meanwhile."""
        while True:
            try:
                code = self.process.wait(WAIT_TICK)
                self.gone = True
                return 128 - code if code < 0 else code
            except subprocess.TimeoutExpired:
                if self.deadline is not None and time.monotonic() > self.deadline:
                    self.process.kill()

    def close(self, hung_up: bool) -> None:
        """Stop serving it, and give the terminal back as it was before the screen took it: a screen
        killed, stopped and continued, or hung up on a terminal that lives, may have left it raw, on
        the alternate screen, with the mouse reported (a moved mouse would type into the shell)."""
        self.server.close()
        if self._tty is None:
            return
        ttou = signal.signal(signal.SIGTTOU, signal.SIG_IGN)  # a background process group may set it too
        try:
            with contextlib.suppress(OSError, termios.error):
                termios.tcsetattr(self._fd, termios.TCSANOW, self._tty)
                if hung_up or self.process.returncode != 0:
                    os.write(self._fd, RESET)
        finally:
            signal.signal(signal.SIGTTOU, ttou)


RESET = b"\x1b[?1000l\x1b[?1002l\x1b[?1003l\x1b[?1006l\x1b[?1015l\x1b[?2004l\x1b[?1049l\x1b[?25h"
"""Mouse reporting (every mode Textual turns on) and bracketed paste off, the alternate screen left, the
cursor shown: what Textual undoes when it leaves, for a screen that could not."""

WAIT_TICK = 0.5
"""How often the wait for the screen looks whether a screen told to leave at once is overdue."""


def _tty_state(fd: int) -> list[Any] | None:
    try:
        return termios.tcgetattr(fd)
    except termios.error:
        return None


def run_tui(hub: Any, script: str, args: list[str], refresh: float) -> int:
    """The script trains in a thread of this process; the main thread starts the screen, takes the
    signals and waits for the screen to leave. The pid, the socket, the output and the exit code are
    those of a headless run's."""
    output = hub.output  # the script's output: the screen and attach clients read it from the hub
    state = _State()
    report = io.StringIO()
    name = os.path.basename(script)
    with captured_output(output.write) as terminal:  # what C code writes joins the script's log

        def train() -> None:
            try:
                code = run_script(script, args, err=report, observe=hub)
            except BaseException as exc:  # a stop at once that landed after the script ended
                code = 128 + signal.SIGTERM if isinstance(exc, _Terminated) else 130
            state.ended = code
            assert state.screen is not None  # the thread starts once the screen has
            state.screen.script_ended(hub.last_step(), code, report.getvalue())

        state.thread = threading.Thread(target=train, name="gputui-training", daemon=True)
        _install_signals(hub, state)  # before the screen: a signal now is a stop, never a lost screen
        screen = state.screen = _Screen(hub, terminal, name, refresh)
        if hub.stop_signal:  # signalled while the screen was being made
            screen.signalled(0, hub.stop_signal)
        state.thread.start()
        if state.forced and not state.raised:  # twice, while the screen was being made: at once, as then
            state.raised = True
            stop = KeyboardInterrupt if state.forced == 128 + signal.SIGINT else _Terminated
            interrupts.interrupt(state.thread, stop)  # raised before the script's first line
            screen.leave(signal.SIGTERM)
        left = screen.wait()
        first = state.ended is None  # the screen left while the script runs: a quit at once, or it failed
        if first and left == 128 + signal.SIGHUP:  # its SIGHUP to us may still be on its way
            state.hung_up = True
        screen.close(state.hung_up)
    thread = state.thread
    if state.hung_up:
        detach_from_terminal()
        thread.join()
        return state.ended or 0
    if first:
        if left > 128 and left - 128 not in (signal.SIGINT, signal.SIGTERM) and not state.forced:
            sys.stderr.write(f"gputui: the screen was ended by signal {left - 128}: stopping the script\n")
        # Stop the script as a second Ctrl-C would, once its save (if any) is whole, so its finally
        # blocks run. A thread blocked in C cannot be interrupted: it gets a moment, then is left behind.
        if not state.raised:
            state.raised = True
            interrupts.interrupt(thread, KeyboardInterrupt)
        interrupts.wait_for_saves(_announce)
        thread.join(UNWIND_S)
    else:
        thread.join()  # it has only the screen's message left to send
    code = state.forced or (left if first or state.ended is None else state.ended)
    lines = output.tail(SCRIPT_TAIL)
    if lines:  # what the script said last (its save, its summary) stays visible
        print(f"gputui: {name} printed (last {len(lines)} lines; l in the TUI shows all):")
        print("\n".join(lines))
    for line in closing_lines(hub):  # how each run ended and what was saved, as headless says it
        print(line)
    if not first and code and not state.forced:
        failure = report.getvalue() or f"exit code {code}"
        sys.stderr.write(failure if failure.endswith("\n") else failure + "\n")
    if thread.is_alive():
        # The script did not unwind: joining it could hang, but a save it started is finished.
        sys.stdout.flush()
        sys.stderr.flush()
        interrupts.exit_after_saves(code, _announce)
    return code


class _State:
    """What run_tui and its signal handlers share."""

    def __init__(self) -> None:
        self.screen: _Screen | None = None
        self.thread: threading.Thread | None = None
        self.ended: int | None = None  # the script's exit code, once it has ended
        self.hung_up = False
        self.raised = False  # an exception was sent to the script's thread to stop it at once
        self.forced = 0  # 128 + the signal that stopped the run at once


def _install_signals(hub: Any, state: _State) -> None:
    """Handlers only set flags and send signals: they may interrupt code that holds a lock."""

    def hangup(signum: int, frame: Any) -> None:
        """The terminal is gone (the screen sends it when no SIGHUP came): training goes on headless."""
        if not state.hung_up:
            state.hung_up = True
            if state.screen is not None:
                state.screen.leave(signal.SIGHUP)

    def stop(signum: int, frame: Any) -> None:
        if hub.stop_signal is None:  # the fit stops after its step, the script finishes, the screen leaves
            hub.stop_signal = STOPS[signum]
            if state.screen is not None:
                state.screen.signalled(hub.last_step(), STOPS[signum])
            return
        state.forced = state.forced or 128 + signum  # the second one: stop now (after a save)
        thread = state.thread
        if thread is not None and thread.is_alive() and state.ended is None and not state.raised:
            state.raised = True
            interrupts.interrupt(thread, KeyboardInterrupt if signum == signal.SIGINT else _Terminated)
        if state.screen is not None:
            state.screen.leave(signal.SIGTERM)

    signal.signal(signal.SIGHUP, hangup)
    for sig in STOPS:
        signal.signal(sig, interrupts.ours(stop))
