import asyncio
import textwrap
import time

import pytest
import textual.app as textual_app
from rich.console import Group
from textual import pilot

from gputui.launch import run_script
from gputui.tui.app import GputuiApp
from gputui.tui.sources import LocalSource

SCRIPT = """
import sys, time
import gputui, torch
from torch import nn

torch.manual_seed(0)
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 32)
        self.blocks = nn.ModuleList(nn.Linear(32, 32) for _ in range(3))
        self.out = nn.Linear(32, 2)
    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = torch.relu(b(x))
        return self.out(x)

model = Net()
calls = []
data = [(torch.randn({batch}, 8), torch.randint(2, ({batch},))) for _ in range({batches})]

def step(model, batch):
    time.sleep({delay})
    calls.append(1)
    {fail}
    return nn.functional.cross_entropy(model(batch[0]), batch[1])

print("script started")
result = gputui.fit(model, data, step, torch.optim.SGD(model.parameters(), lr=0.1), {extra})
gputui.save({{"steps": result.steps}}, sys.argv[1])
print("saved after", result.steps, "steps")
"""


def make_script(*, batch=16, batches=3000, delay=0.01, fail="", extra=""):
    return textwrap.dedent(SCRIPT.format(batch=batch, batches=batches, delay=delay, fail=fail, extra=extra))


async def _app_idle(min_sleep: float = 0.02, max_sleep: float = 1.0) -> None:
    """textual's wait_for_idle() with the event loop's thread as the measure of work: it waits until the
    process's CPU time stops advancing (for a second at most), and an app whose training thread trains
    never lets it, so each wait was that whole second. The app's own work (its handlers, its drawing)
    runs on this thread: that is what a key press waits for."""
    start = time.monotonic()
    while True:
        cpu = time.thread_time()
        await asyncio.sleep(0.02)
        elapsed = time.monotonic() - start
        if elapsed >= max_sleep or (elapsed > min_sleep and time.thread_time() - cpu < 0.001):
            return


@pytest.fixture(autouse=True)
def app_idle_waits(monkeypatch):
    """Pilot's press() (twice a key), click() and pause() wait for the app, not for the training thread."""
    for module in (textual_app, pilot):  # each imported wait_for_idle by name
        monkeypatch.setattr(module, "wait_for_idle", _app_idle)


@pytest.fixture
def utc(monkeypatch):
    """Timeline clocks in UTC, so snapshots do not depend on the machine's time zone."""
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.delenv("TZ")
    time.tzset()


@pytest.fixture
def script_app(hub, tmp_path):
    """Apps running a real script (`code`, written to tmp_path/`name`) in their training thread, fed from
    the test's hub; `observe`: an own loop, observed. Each run is stopped (fit after its step, an own loop
    by a KeyboardInterrupt) and its thread joined when the test ends: none trains on into the next test."""
    apps = []

    def make(code, name="train.py", argv=(), observe=False):
        path = tmp_path / name
        path.write_text(code)
        observed = {"observe": hub} if observe else {}

        def runner(err):
            return run_script(str(path), list(argv), err=err, **observed)

        apps.append(GputuiApp(LocalSource(hub), script=name, refresh=20, runner=runner))
        return apps[-1]

    yield make
    hub.controls.request("stop")
    for app in apps:
        if app.training_thread is not None:  # an app never run starts no thread
            app.training_thread.join(30)
            assert not app.training_thread.is_alive()


@pytest.fixture
def make_app(script_app, tmp_path):
    """An app training SCRIPT (make_script's keywords), which saves to tmp_path/saved.pt."""
    return lambda **script: script_app(make_script(**script), argv=[str(tmp_path / "saved.pt")])


@pytest.fixture
def own_loop_app(script_app):
    """An app observing a script with its own training loop (`code`, written to own.py)."""
    return lambda code: script_app(code, name="own.py", observe=True)


async def until(pilot, condition, timeout=20.0):
    """Let the app run until `condition()` holds (or fail after `timeout` seconds)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await pilot.pause(0.01)


def text(app, selector):
    """What a panel of the main screen shows, as plain text."""
    rendered = app.main.query_one(selector).render()
    if isinstance(rendered, Group):
        return "\n".join(part.plain for part in rendered.renderables)
    return rendered.plain
