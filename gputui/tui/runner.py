"""Running the app: on a local script (`gputui run`), on a job elsewhere (`gputui attach`), or on
the torchrun job it launched (`gputui run --nproc-per-node`).

Each owns the terminal for the app's lifetime and give it back intact. When the terminal goes
away (SIGHUP: an SSH session dropped, a tmux window killed; or a hang-up terminal.py notices),
a local run closes the app and goes on headless: the training thread keeps training, the
socket keeps serving, and the process exits with the script's code when it ends. SIGTERM and
SIGINT act as they do headless: the fit stops after its step, the script finishes (its save
runs), the app closes; a second one stops the script at once, or right after a save in progress.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
from typing import Any, TextIO

from .. import interrupts
from ..launch import detach_from_terminal, run_script
from ..telemetry.client import Mirror
from ..torchrun import KILL_AFTER, TorchrunJob
from .app import GputuiApp
from .remote import RemoteSource
from .sources import LocalSource
from .terminal import Terminal, guarded_terminal

SCRIPT_TAIL = 15
"""Lines of the script's own output printed when the app closes."""


UNWIND_S = 2.0
"""How long a script stopped at once gets to unwind before the process exits without it."""

STOPS: dict[int, str] = {signal.SIGINT: "interrupted", signal.SIGTERM: "terminated"}


class _Terminated(SystemExit):
    """A second SIGTERM, raised in the script's thread: it ends as headless would (code 143)."""

    def __init__(self) -> None:
        super().__init__(128 + signal.SIGTERM)


def _announce(path: str) -> None:
    sys.stderr.write(f"gputui: waiting for the save of {path} to finish\n")
    sys.stderr.flush()


def _schedule(callback: Any, *args: Any) -> None:
    """From a signal handler, between two steps of the app's event loop: schedule, do not call."""
    try:
        asyncio.get_running_loop().call_soon_threadsafe(callback, *args)
    except RuntimeError:  # the loop is not running (the app has not started or has ended)
        pass


def _leave_when_done(app: GputuiApp, signum: int) -> None:
    """SIGTERM or SIGINT: the running fit stops at its next boundary (hub.stop_signal), the script
    finishes (its save runs), then the app exits with the script's code."""
    thread = app.training_thread
    if thread is None or not thread.is_alive():
        app.exit(app.script_code if app.script_code is not None else 128 + signum)
        return
    app.view.stopping = True
    app.notify(
        f"{STOPS[signum]}: finishing the current step; the script then finishes (its save runs) and "
        "gputui exits. Again to stop at once.",
        timeout=30,
    )

    def wait() -> None:
        thread.join()
        app.exit(app.script_code)  # posted after the script's ScriptEnded: its report is shown first

    threading.Thread(target=wait, name="gputui-leave", daemon=True).start()


def _install_signals(app: GputuiApp, hub: Any, terminal: Terminal, hung_up: list[bool], raised: list[bool]) -> None:
    """Handlers only set flags and schedule: they may interrupt code that holds a lock."""

    def hangup(signum: int, frame: Any) -> None:
        if not hung_up:
            hung_up.append(True)
            terminal.release()  # Textual's last writes go nowhere instead of failing
            _schedule(app.exit, None)

    def stop(signum: int, frame: Any) -> None:
        if hub.stop_signal is None:
            hub.stop_signal = STOPS[signum]
            _schedule(_leave_when_done, app, signum)
            return
        thread = app.training_thread  # the second one: stop now (after a save), as headless does
        if thread is not None and thread.is_alive() and not raised:
            raised.append(True)
            interrupts.interrupt(thread, KeyboardInterrupt if signum == signal.SIGINT else _Terminated)
        _schedule(app.exit, 128 + signum)

    signal.signal(signal.SIGHUP, hangup)
    for sig in STOPS:
        signal.signal(sig, stop)


def run_tui(hub: Any, script: str, args: list[str], refresh: float) -> int:
    output = hub.output  # the script's output: the app shows it, attach clients get it from the hub
    hung_up: list[bool] = []
    raised: list[bool] = []  # an exception was sent to the script's thread to stop it at once
    with guarded_terminal(output.write) as terminal:  # what C code writes joins the script's log
        app = GputuiApp(
            LocalSource(hub),
            script=os.path.basename(script),
            runner=lambda err: run_script(script, args, err=err, observe=hub),
            refresh=refresh,
            printed=output.write,
        )
        _install_signals(app, hub, terminal, hung_up, raised)
        app.run()
    thread = app.training_thread
    if hung_up:
        detach_from_terminal()
        if thread is not None:
            thread.join()
        return app.script_code if app.script_code is not None else 0
    if thread is not None and thread.is_alive():
        # A quit at once (a second q, Ctrl-C or signal): stop the script as a second Ctrl-C would,
        # once its save (if any) is whole, so its finally blocks run (fit writes its end record).
        # A thread blocked in C cannot be interrupted: it gets a moment, then is left behind.
        if not raised:
            interrupts.interrupt(thread, KeyboardInterrupt)
        interrupts.wait_for_saves(_announce)
        thread.join(UNWIND_S)
    if app.return_code:  # the app itself failed: its report went to the captured output
        lines = output.tail(60)
        sys.stderr.write(
            "\n".join(lines) + "\ngputui: error: the TUI stopped on an internal error (above); "
            "`gputui run --headless` runs without it\n"
        )
    code = app.return_value if app.return_value is not None else 1
    lines = output.tail(SCRIPT_TAIL)
    if lines and not app.return_code:  # what the script said last (its save, its summary) stays visible
        print(f"gputui: {os.path.basename(script)} printed (last {len(lines)} lines; l in the TUI shows all):")
        print("\n".join(lines))
    if app.view.failure:
        sys.stderr.write(app.view.failure if app.view.failure.endswith("\n") else app.view.failure + "\n")
    if thread is not None and thread.is_alive():
        # The script did not unwind: joining it could hang, but a save it started is finished.
        sys.stdout.flush()
        sys.stderr.flush()
        interrupts.exit_after_saves(code, _announce)
    return code


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
    once; the job is killed KILL_AFTER s after the first stop. A hang-up leaves the job running, as
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
        sys.stderr.write(f"gputui: stopping the torchrun job (killed after {KILL_AFTER:g} s)\n")
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
