"""The script's output on an attached screen (a job served in this process): `gputui run`'s own screen
reads it the same way (test_own_screen.py; tests/integration/test_signals.py on real processes)."""

import os
import threading
import time

import pytest
from conftest import text, until
from samples import step_sample
from test_output import LONG
from textual.widgets import RichLog, Static

from gputui.telemetry.client import Mirror
from gputui.telemetry.hub import Hub
from gputui.telemetry.run import RunInfo
from gputui.telemetry.sample import Memory
from gputui.telemetry.server import TelemetryServer
from gputui.tui.app import GputuiApp
from gputui.tui.remote import RemoteSource
from gputui.tui.screens import LogScreen


@pytest.fixture
def job(tmp_path, monkeypatch):
    """An own-loop job served on a socket: before attaching it printed 300 lines; then a progress bar
    redraws itself and a line is printed every few steps."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    hub = Hub()
    server = TelemetryServer(hub).start()
    stop = threading.Event()
    hub.start(RunInfo(mode="observe", device="cpu", argv=("own.py",), pid=4242))
    for i in range(300):
        hub.output.write(f"early line {i}\n")
    hub.output.write(f"\x1b[1mLINE-START\x1b[0m {LONG}\n")

    def train():
        step = 0
        while not stop.is_set():
            step += 1
            hub.output.write(f"\rtraining {step}/10000 |{'#' * (step % 20):<20}|")
            if step % 10 == 0:  # over the bar, as tqdm.write() does
                hub.output.write(f"\rstep {step}: loss {2.0 / step:.4f}\n")
            hub.publish(
                step_sample(
                    step,
                    t=time.time(),
                    loss=2.0 / step,
                    batch_size=16,
                    samples_per_s=800.0,
                    memory=Memory("cpu", allocated=1000, peak=2000),
                )
            )
            time.sleep(0.02)

    thread = threading.Thread(target=train, daemon=True)
    thread.start()
    yield hub, server
    stop.set()
    thread.join(5)
    server.close()


async def test_an_attached_screen_shows_the_jobs_output(job):
    hub, server = job
    mirror = Mirror(server.path, os.getpid()).start()
    app = GputuiApp(RemoteSource(mirror, control=False), script="", refresh=20)
    app.view.remote = True
    try:
        async with app.run_test(size=(100, 50)) as pilot:
            # the bar is the line being written: absent for a moment after each "step" line ends it
            await until(pilot, lambda: "step 10: loss" in text(app, "#log") and "training " in text(app, "#log"))
            panel = text(app, "#log")
            assert "LINE-START {'loss': '6.034'" in panel and "'marker': 'END'}" in panel  # whole, no escapes
            assert panel.count("training ") == 1 and "\n\n" not in panel  # the bar: one line that changes
            lines = list(app.output.lines)
            steps = sum(line.startswith("step ") for line in lines)
            printed = [
                *(f"early line {i}" for i in range(300)),
                f"LINE-START {LONG}",
                *(f"step {n}: loss {2.0 / n:.4f}" for n in range(10, 10 * steps + 1, 10)),
            ]
            shown = len(lines) - 1  # the welcome's recent lines, then each line as printed, in order
            assert lines == [f"… {len(printed) - shown} lines not shown (printed before attaching)", *printed[-shown:]]
            assert "early line 299" in lines
            await pilot.press("l")
            assert isinstance(app.screen, LogScreen)
            log = app.screen.query_one(RichLog)
            await until(pilot, lambda: any("LINE-START" in line.text for line in log.lines))
            current = app.screen.query_one("#output-current", Static)
            await until(pilot, lambda: "training " in str(current.render()))
            assert not any("training " in line.text for line in log.lines)
            shown = len(log.lines)
            await until(pilot, lambda: len(log.lines) > shown)  # it goes on as the job prints
    finally:
        mirror.stop()
