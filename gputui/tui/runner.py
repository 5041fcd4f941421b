"""Running the app: `gputui run`'s screen (local.py starts it), a job elsewhere (`gputui attach`), or
the torchrun job it launched (`gputui run --nproc-per-node`). Each gives the terminal back intact.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
import time
from functools import partial
from typing import Any, TextIO

from ..launch import detach_from_terminal
from ..telemetry.client import Mirror
from ..telemetry.output import OutputLog
from ..torchrun import TorchrunJob
from .app import GputuiApp
from .local import STOPS
from .remote import RemoteSource
from .terminal import Terminal, guarded_terminal

GONE_WAIT = 0.5
"""Seconds the screen gives a run whose end of the pair closed to be gone (else it let the screen go)."""


def _schedule(callback: Any, *args: Any) -> bool:
    """From a signal handler, between two steps of the app's event loop: schedule, do not call.
    False if no loop runs (the app has not started, or has ended)."""
    try:
        asyncio.get_running_loop().call_soon_threadsafe(callback, *args)
    except RuntimeError:
        return False
    return True


def screen_main(argv: list[str]) -> int:
    """`python -m gputui.tui FD PID SCRIPT REFRESH`: the screen `gputui run` starts (_Screen). Its exit
    code: the script's, 130 for a quit at once, 1 if it failed, 129 when the terminal hung up."""
    fd, pid, script, refresh = int(argv[0]), int(argv[1]), argv[2], float(argv[3])
    apps: list[GputuiApp] = []
    hung_up: list[bool] = []
    terminals: list[Terminal] = []
    pending: list[int | None] = []  # an exit asked for before the app's loop ran: the app does not start

    def leave(code: int | None) -> None:
        if not _schedule(lambda: apps[0].exit(code) if apps else None):
            pending.append(code)

    def hangup(signum: int, frame: Any) -> None:
        if not hung_up:
            hung_up.append(True)
            if terminals:
                terminals[0].release()  # Textual's last writes go nowhere instead of failing
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGHUP)  # the run goes on headless
            leave(None)

    def quit_now(signum: int, frame: Any) -> None:  # the run tells it to leave at once, or the run died
        leave(128 + signum)

    signal.signal(signal.SIGHUP, hangup)
    signal.signal(signal.SIGTERM, quit_now)  # SIGINT stays ignored (__main__.py): the run takes a Ctrl-C
    mirror = Mirror(f"fd {fd}", pid, control=True, sock=socket.socket(fileno=fd)).start()
    log = OutputLog()
    with guarded_terminal(log.write) as terminal:
        terminals.append(terminal)
        app = GputuiApp(
            RemoteSource(mirror, control=True), script=script, runner=partial(_script_end, mirror), refresh=refresh
        )
        apps.append(app)
        if not pending:
            app.run()
    mirror.stop()
    if pending and not hung_up:
        return pending[0] or 1
    if hung_up:
        return 128 + signal.SIGHUP
    if app.return_code:  # the app itself failed: its report went to the captured output
        sys.stderr.write(
            "\n".join(log.tail(60)) + "\ngputui: error: the TUI stopped on an internal error (above); "
            "`gputui run --headless` runs without it\n"
        )
        return 1
    return app.return_value if app.return_value is not None else 1


def _script_end(mirror: Mirror, report: TextIO) -> int:
    """The screen's "script": it ends when the run says its script has, or when the run is gone."""
    mirror.done.wait()
    event = mirror.script_ended
    if event is None and _lives(mirror.pid):
        # The run lives, but let this screen go (it fell too far behind: stopped for a minute): the run
        # goes on headless, as after a hang-up, rather than be stopped by a quit from a stale screen.
        os.kill(os.getpid(), signal.SIGHUP)
    if event is None:
        report.write(f"gputui: {mirror.status or 'the run is gone'}\n")
        return 1
    lines, code = event.get("report"), event.get("code")
    if isinstance(lines, list):
        report.write("".join(f"{line}\n" for line in lines if isinstance(line, str)))
    return code if isinstance(code, int) else 1


def _lives(parent: int | None) -> bool:
    """Whether the run that started this screen is still there: a run that dies closes its end of the
    pair a moment before this process is handed to another parent (and sent SIGTERM)."""
    time.sleep(GONE_WAIT)
    return parent is not None and os.getppid() == parent


def attach_tui(path: str, pid: int | None, *, control: bool, refresh: float) -> int:
    mirror = Mirror(path, pid, control=control).start()
    app = GputuiApp(RemoteSource(mirror, control=control), script="", refresh=refresh)
    app.view.remote = True
    app.run()
    mirror.stop()
    return 0 if not app.return_code else 1


class _JobSource(RemoteSource):
    """Rank 0 of a torchrun job, steered with control; its stop (q, Ctrl-C) goes to every rank as a
    signal (torchrun.py says why), so it works before rank 0 is connected and for an own loop too."""

    def __init__(self, mirror: Mirror, job: TorchrunJob) -> None:
        super().__init__(mirror, control=True)
        self.job = job

    def request(self, action: str, value: Any = None) -> int | None:
        if action == "stop":
            self.job.stop()
            return None
        return super().request(action, value)


def torchrun_tui(job: TorchrunJob, pid: int, path: str, *, script: str, refresh: float) -> int:
    """The TUI attached to rank 0 (`pid`, its socket `path`) of `job`, with control: the keys act on
    every rank through the exchange. The job's end is the app's "script" ending: q or Ctrl-C stop every
    rank after the same step and the app leaves when torchrun has ended; a second one stops them at
    once; the job is killed `job.kill_after` s after the first stop. A hang-up leaves the job running, as
    `gputui run` leaves its script: the app closes and this process exits with torchrun's code."""
    mirror = Mirror(path, pid, control=True).start()
    hung_up: list[bool] = []
    apps: list[GputuiApp] = []

    def ended(report: TextIO) -> int:
        code = job.wait()
        if code:
            report.write(f"torchrun ended with exit code {code}; its log {job.log} ends with:\n")
            report.write("\n".join(job.tail()) + "\n")
        return code or 0

    with guarded_terminal(lambda text: apps[0].output.write(text) if apps else None) as terminal:
        app = GputuiApp(_JobSource(mirror, job), script=os.path.basename(script), runner=ended, refresh=refresh)
        apps.append(app)
        app.view.remote = True

        def hangup(signum: int, frame: Any) -> None:
            if not hung_up:
                hung_up.append(True)
                terminal.release()
                _schedule(app.exit, None)

        signal.signal(signal.SIGHUP, hangup)
        for sig in STOPS:  # a signal to this process acts as Ctrl-C in the app: stop, then at once
            signal.signal(sig, lambda signum, frame: _schedule(app.action_interrupt))
        app.run()
    mirror.stop()
    if hung_up:
        detach_from_terminal()
        return job.wait() or 0
    for sig in STOPS:  # from here, a Ctrl-C in the terminal stops the ranks at once
        signal.signal(sig, lambda signum, frame: job.stop())
    if job.returncode() is None:  # q again after a stop (then at once), or the app failed (then after the step)
        job.stop()
        sys.stderr.write(f"gputui: stopping the torchrun job (killed after {job.kill_after:g} s)\n")
        job.wait()
    if app.return_code:
        sys.stderr.write(
            "\n".join(app.output.tail(60)) + "\ngputui: error: the TUI stopped on an internal error (above)\n"
        )
    code = job.returncode() or 0
    lines = job.tail()
    print(f"gputui: torchrun's output, every rank's: {job.log} (last {len(lines)} lines):")
    print("\n".join(lines))
    return code
