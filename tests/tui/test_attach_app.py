"""The app on a job in 'another process' (a server in this one): watch-only keys, control, the end."""

import io
import os
import threading
import time

import pytest
from conftest import text, until
from rich.console import Console
from samples import step_sample

from gputui.telemetry.client import Mirror
from gputui.telemetry.hub import Hub
from gputui.telemetry.run import RunInfo, RunSummary
from gputui.telemetry.sample import Event, Memory, RankMemory
from gputui.telemetry.server import TelemetryServer
from gputui.tui.app import GputuiApp
from gputui.tui.remote import RemoteSource


@pytest.fixture
def job(tmp_path, monkeypatch, request):
    """A hub served on a socket, training-like: a sample every 20 ms, controls answered at boundaries;
    a parametrized test's param: more fields of its info."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    hub = Hub()
    server = TelemetryServer(hub).start()
    stop = threading.Event()
    info = RunInfo(
        device="cpu",
        device_name="CPU",
        argv=("/home/ada/train.py", "--lr", "3"),
        pid=4242,
        total_steps=10_000,
        auto_recover=True,
        **getattr(request, "param", {}),
    )
    hub.start(info)

    def train():
        step, micro = 0, 64
        while not stop.is_set():
            for control in hub.controls.drain():
                if control.action == "halve_batch":
                    hub.emit(
                        Event(
                            "micro_batch_changed",
                            step,
                            {
                                "from": micro,
                                "to": micro // 2,
                                "accumulation": 2,
                                "request_id": control.id,
                                "latency_s": 0.01,
                            },
                        )
                    )
                    micro //= 2
                elif control.action == "pause":
                    hub.emit(Event("paused", step, {"request_id": control.id}))
            step += 1
            hub.publish(
                step_sample(
                    step,
                    t=time.time(),
                    loss=2.0 / step,
                    batch_size=64,
                    micro_batch=micro,
                    samples_per_s=3200.0,
                    memory=Memory("cpu", allocated=1000, peak=2000),
                    # under torchrun, every rank's as the exchange gave them: rank 1 the worst
                    ranks=tuple(RankMemory(r, micro, (2 + 3 * r) * 2**20, 8 * 2**20) for r in range(info.world_size))
                    if info.world_size > 1
                    else (),
                )
            )
            time.sleep(0.02)
        hub.end(RunSummary(steps=step, samples=step * 64, stopped="requested", elapsed_s=3.0))

    thread = threading.Thread(target=train, daemon=True)
    thread.start()
    yield hub, server, stop
    stop.set()
    thread.join(5)
    server.close()


def attach(server, control):
    mirror = Mirror(server.path, os.getpid(), control=control).start()
    app = GputuiApp(RemoteSource(mirror, control=control), script="", refresh=20)
    app.view.remote = True
    return app, mirror


async def test_watch_only_attach_shows_the_job_and_dims_the_remedies(job):
    hub, server, stop = job
    app, mirror = attach(server, control=False)
    said = []
    notify = app.notify
    app.notify = lambda message, **kw: (said.append(message), notify(message, **kw))
    async with app.run_test(size=(100, 30)) as pilot:
        await until(pilot, lambda: app.view.latest is not None and app.view.latest.step > 3)
        assert "train.py · pid 4242 │ watch-only │ training" in text(app, "#header")
        assert not app.main.query_one("#ranks").display  # one process: no ranks
        assert app.check_action("halve_batch", ()) is None
        await pilot.press("b")
        await pilot.pause(0.2)
        assert said == ["watch-only: attach with --control to steer"] and len(hub.controls) == 0
        await pilot.press("w")  # the planner shows what the job sent, and offers no r to ask again
        await until(pilot, lambda: app.screen.id != "_default" and "escape" in app.active_bindings)
        assert "r" not in app.active_bindings
        await pilot.press("escape")
        stop.set()  # the job ends: its final state stays on screen
        await until(pilot, lambda: mirror.hub.summary is not None)
        server.close()
        await until(pilot, lambda: "the job stopped (requested)" in text(app, "#header"))
        assert len(app.view.series.loss) > 3
    mirror.stop()


async def test_control_attach_steers_the_job(job):
    hub, server, stop = job
    app, mirror = attach(server, control=True)
    async with app.run_test(size=(100, 30)) as pilot:
        await until(pilot, lambda: app.view.latest is not None and app.view.latest.step > 3)
        await pilot.press("b")
        await until(pilot, lambda: "micro-batch 32 × 2 = 64" in text(app, "#remedies"))
        assert "✓ micro-batch 64 -> 32" in text(app, "#timeline")
        assert not app.view.pending
        assert "train.py · pid 4242 │ steering │ training" in text(app, "#header")
        await pilot.press("question_mark")
        console = Console(width=200, record=True, file=io.StringIO())
        console.print(app.screen.query_one("#help-text").content)
        helped = [line.strip().split(None, 1) for line in console.export_text().splitlines() if line.strip()]
        assert ["q", "Leave this screen; the job trains on (gputui attach again to come back)."] in helped
        assert ["ctrl+c", "Leave this screen; the job trains on (gputui attach again to come back)."] in helped
        await pilot.press("escape")
        await pilot.press("p")  # paused from here, then q: the job would wait for no one
        await until(pilot, lambda: app.view.paused)
        await pilot.press("q")
        await pilot.pause(0.1)
        assert app.is_running and any("stays paused" in n.message for n in app._notifications)
        await pilot.press("q")  # told: it leaves
        await until(pilot, lambda: not app.is_running)
    mirror.stop()


@pytest.mark.parametrize("job", [{"rank": 1, "world_size": 2, "job": "run7@node0:29500"}], indirect=True)
async def test_an_attached_rank_says_which_it_is(job):
    """Each rank of a torchrun job serves its own socket: attached to one, the header says which."""
    hub, server, stop = job
    app, mirror = attach(server, control=False)
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: app.view.latest is not None)
        assert "train.py · pid 4242 │ rank 1 of 2 │ training" in text(app, "#header"), text(app, "#header")
        await until(pilot, lambda: app.main.query_one("#ranks").display)
        lines = text(app, "#ranks").splitlines()  # every rank's memory, read from the job's JSON
        assert lines[0].startswith("rank 0  ") and "2.00M / 8.00M  25%  mb 64" in lines[0]
        assert lines[1].startswith("rank 1  ") and lines[1].rstrip().endswith(
            "5.00M / 8.00M  62%  mb 64  ◀ worst · this"
        )
    mirror.stop()
