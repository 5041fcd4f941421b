"""Running the app: on a local script (`gputui run`) or on a job elsewhere (`gputui attach`).

Both own the terminal for the app's lifetime and give it back intact. When the terminal goes
away (SIGHUP: an SSH session dropped, a tmux window killed), a local run closes the app and
goes on headless: the training thread keeps training, the socket keeps serving, and the
process exits with the script's code when it ends.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
from typing import Any

from ..launch import detach_from_terminal, run_script
from .app import GputuiApp
from .model import LocalSource, OutputLog
from .terminal import guarded_output

SCRIPT_TAIL = 15
"""Lines of the script's own output printed when the app closes."""


def _on_hangup(app: GputuiApp, hung_up: threading.Event) -> None:
    def handler(signum: int, frame: Any) -> None:
        hung_up.set()
        try:  # runs on the event loop's thread, between two of its steps: schedule, do not call
            asyncio.get_running_loop().call_soon_threadsafe(app.exit, None)
        except RuntimeError:
            pass

    signal.signal(signal.SIGHUP, handler)


def run_tui(hub: Any, script: str, args: list[str], refresh: float) -> int:
    output = OutputLog()
    hung_up = threading.Event()
    with guarded_output(output.write):  # what C code writes joins the script's log
        app = GputuiApp(LocalSource(hub), script=os.path.basename(script),
                        runner=lambda err: run_script(script, args, err=err, observe=hub), refresh=refresh,
                        output=output)
        _on_hangup(app, hung_up)
        app.run()
    thread = app.training_thread
    if hung_up.is_set():
        detach_from_terminal()
        if thread is not None:
            thread.join()
        return app.script_code if app.script_code is not None else 0
    if app.return_code:  # the app itself failed: its report went to the captured output
        lines, _ = output.since(max(0, output.total - 60))
        sys.stderr.write("\n".join(lines) + "\ngputui: error: the TUI stopped on an internal error (above); "
                         "`gputui run --headless` runs without it\n")
    code = app.return_value if app.return_value is not None else 1
    lines, _ = output.since(max(0, output.total - SCRIPT_TAIL))
    if lines and not app.return_code:  # what the script said last (its save, its summary) stays visible
        print(f"gputui: {os.path.basename(script)} printed (last {len(lines)} lines; l in the TUI shows all):")
        print("\n".join(lines))
    if app.view.failure:
        sys.stderr.write(app.view.failure if app.view.failure.endswith("\n") else app.view.failure + "\n")
    if thread is not None and thread.is_alive():
        # Quit while the script still runs: nothing more to wait for, and joining it would hang.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def attach_tui(path: str, pid: int | None, *, control: bool, refresh: float) -> int:
    from ..telemetry.client import Mirror
    from .remote import RemoteSource

    mirror = Mirror(path, pid, control=control).start()
    app = GputuiApp(RemoteSource(mirror, control=control), script="", refresh=refresh)
    app.view.remote = True
    app.run()
    mirror.stop()
    return 0 if not app.return_code else 1
