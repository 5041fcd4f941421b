"""`gputui run`'s screen as its own process runs it: attached to the run through one end of a socket
pair (no socket folder), with control, its "script" ending when the run says so."""

import os
import socket
from functools import partial

import pytest
from conftest import text, until
from fakes import cpu_sample

from gputui.telemetry.client import Mirror
from gputui.telemetry.hub import Hub
from gputui.telemetry.run import RunInfo
from gputui.telemetry.sample import Event
from gputui.telemetry.server import TelemetryServer
from gputui.tui.app import GputuiApp
from gputui.tui.remote import RemoteSource
from gputui.tui.runner import _script_end
from gputui.tui.screens import FailureScreen


@pytest.fixture
def run(tmp_path, monkeypatch):
    """A run served only on a socket pair, its screen's end given to a Mirror: (hub, server, screen app)."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))  # nothing may appear there
    hub = Hub()
    ours, theirs = socket.socketpair()
    server = TelemetryServer(hub)
    server.adopt(ours, os.getpid())
    server.start(listen=False)
    mirror = Mirror("fd", os.getpid(), control=True, sock=theirs).start()
    app = GputuiApp(
        RemoteSource(mirror, control=True), script="train.py", runner=partial(_script_end, mirror), refresh=20
    )
    yield hub, server, app
    mirror.stop()
    server.close()
    assert not os.path.exists(tmp_path / "gputui") or os.listdir(tmp_path / "gputui") == []


async def test_the_screen_shows_the_run_steers_it_and_shows_how_its_script_ended(run):
    hub, server, app = run
    hub.start(RunInfo(mode="fit", device="cpu", argv=("train.py",), pid=os.getpid()))
    async with app.run_test(size=(110, 40)) as pilot:
        for step in range(1, 6):
            hub.publish(cpu_sample(step))
        hub.output.write("epoch 1 done\n")
        await until(pilot, lambda: app.view.latest is not None and app.view.latest.step == 5)
        await until(pilot, lambda: "epoch 1 done" in app.output.lines)  # what `l` shows
        await pilot.press("b")  # over the pair, with control: the run answers with its request id
        await until(pilot, lambda: "requested: halve micro-batch" in text(app, "#timeline"))
        assert [c.action for c in hub.controls.drain()] == ["halve_batch"]
        assert app.training_thread.is_alive(), "the script runs until the run says it ended"
        report = ["Traceback (most recent call last):", '  File "train.py", line 9', "ValueError: boom"]
        server.on_event(Event("script_ended", 5, {"code": 3, "report": report}))
        await until(pilot, lambda: isinstance(app.screen, FailureScreen))
        assert app.view.exit_code == 3 and app.view.failure == "\n".join(report) + "\n", "line by line"
        await pilot.press("q")
    assert app.return_value == 3, "q leaves with the script's code"


async def test_signalled_the_screen_leaves_with_the_code_once_the_script_has_ended(run):
    hub, server, app = run
    async with app.run_test(size=(110, 40)) as pilot:
        await until(pilot, lambda: app.source.mirror.status is None)  # live
        server.on_event(Event("signalled", 0, {"reason": "terminated"}))  # `gputui run` got a SIGTERM
        await until(pilot, lambda: app.view.stopping)
        await pilot.pause(0.3)
        assert app.is_running, "it waits for the script (its save) to end"
        server.on_event(Event("script_ended", 0, {"code": 0, "report": []}))
        await until(pilot, lambda: not app.is_running)
    assert app.return_value == 0


async def test_a_run_that_is_gone_ends_the_screens_script_with_why(run):
    hub, server, app = run
    async with app.run_test(size=(110, 40)) as pilot:
        await until(pilot, lambda: app.source.mirror.status is None)
        server.close()  # the pair's far end closes with no word of the script: a run killed
        await until(pilot, lambda: isinstance(app.screen, FailureScreen))
        assert app.view.exit_code == 1
        assert "the job is gone without a final record" in app.view.failure
