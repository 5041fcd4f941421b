"""The `gputui watch` screen on handmade NVML readings: devices, processes, status, keys.

After a deliberate change to the screen: `pytest tests/tui/test_watch_app.py --snapshot-update`,
then look at the new SVG before committing it.
"""

import io

import pytest
from rich.console import Group
from textual.widgets import DataTable

from gputui import watch
from gputui.telemetry.sample import GpuDevice, GpuProcess, GpuReading
from gputui.tui.watch_app import DeviceList, WatchApp, WatchHelp

pytestmark = pytest.mark.usefixtures("utc")  # timeline clocks in UTC: stable snapshots

GiB, MiB = 2**30, 2**20
T0 = 1_795_000_000.0  # 2026-11-18 11:06:40 UTC

H100 = dict(name="NVIDIA H100 80GB HBM3", memory_total=80 * GiB, power_limit=700.0)
GPUS = GpuReading(
    t=T0,
    driver="580.159.04",
    devices=(
        GpuDevice(
            0,
            utilization=97,
            memory_used=int(61.2 * GiB),
            temperature=61,
            power=598.0,
            **H100,
            processes=(
                GpuProcess(4242, 48 * GiB, "compute", "ada", "python train.py --model gpt2-xl"),
                GpuProcess(5120, None, "compute"),  # a PID from another namespace: memory, user and command hidden
                GpuProcess(1733, 300 * MiB, "graphics", "root", "Xorg :0"),
            ),
        ),
        GpuDevice(
            1,
            utilization=4,
            memory_used=int(12.6 * GiB),
            temperature=38,
            power=91.0,
            **H100,
            processes=(GpuProcess(7001, 12 * GiB, "compute", "bo", "python -m vllm.entrypoints.openai.api_server"),),
        ),
        GpuDevice(2, name="Tesla K80"),  # every figure NotSupported
        GpuDevice(3, error="NVML could not read this GPU: GPU is lost"),
    ),
)
NO_DRIVER = GpuReading(t=T0, status="no NVIDIA driver is loaded (nvidia-smi would fail too)")


class FakePoller:
    """What NvmlPoller gives the app: the newest reading, replaced (never mutated) by the test."""

    def __init__(self, reading=GPUS):
        self.reading = reading

    def latest(self):
        return self.reading


def make(reading=GPUS):
    return WatchApp(FakePoller(reading), refresh=50, host="gpu-box")


def rendered(app, selector):
    widget = app.screen.query_one(selector)
    content = widget.render() if isinstance(widget, DeviceList) else widget.content
    return "\n".join(t.plain for t in content.renderables) if isinstance(content, Group) else content.plain


def rows(app):
    table = app.query_one(DataTable)
    return [[str(cell) for cell in table.get_row_at(i)] for i in range(table.row_count)]


def pids(app):
    return [int(row[1]) for row in rows(app)]


async def test_devices_show_every_figure_and_na_for_what_nvml_refused():
    async with make().run_test(size=(100, 30)) as pilot:
        await pilot.pause()
        lines = rendered(pilot.app, "#devices").splitlines()
        header = rendered(pilot.app, "#header")

    assert "gpu-box" in header and "driver 580.159.04" in header and "2026-11-18 11:06:40" in header
    assert lines[0].startswith("GPU0 H100 80GB HBM3")
    assert "util  97% █████████" in lines[0] and "61°C" in lines[0] and "598 W / 700 W" in lines[0]
    assert lines[1].lstrip().startswith("mem ██") and lines[1].endswith("61.2 GiB / 80.0 GiB (76%)")
    assert "util   4%" in lines[2] and "12.6 GiB / 80.0 GiB (16%)" in lines[3]
    assert lines[4].startswith("GPU2 Tesla K80") and lines[4].count("n/a") == 4  # util, temperature, power, limit
    assert "█" not in lines[4] + lines[5] and lines[5].endswith("n/a / n/a")
    assert lines[6] == "GPU3 NVML could not read this GPU: GPU is lost" and len(lines) == 7


async def test_processes_sorted_by_memory_with_hidden_ones_last():
    async with make().run_test(size=(100, 30)) as pilot:
        await pilot.pause()
        table = rows(pilot.app)
        title = pilot.app.query_one(DataTable).border_title

    assert table == [
        ["0", "4242", "ada", "48.0 GiB", "compute", "python train.py --model gpt2-xl"],
        ["1", "7001", "bo", "12.0 GiB", "compute", "python -m vllm.entrypoints.openai.api_server"],
        ["0", "1733", "root", "300 MiB", "graphics", "Xorg :0"],
        ["0", "5120", "n/a", "n/a", "compute", "n/a"],
    ]
    assert title == "processes (4) · sorted by memory"


async def test_s_cycles_the_sort_and_the_cursor_stays_on_its_process():
    async with make().run_test(size=(100, 30)) as pilot:
        await pilot.pause()
        table = pilot.app.query_one(DataTable)
        await pilot.press("down")  # onto 7001
        orders = [pids(pilot.app)]
        for _ in range(3):
            await pilot.press("s")
            orders.append(pids(pilot.app))
        cursor = table.get_row_at(table.cursor_row)[1]
        title = table.border_title

    assert orders == [
        [4242, 7001, 1733, 5120],
        [1733, 4242, 5120, 7001],
        [4242, 1733, 5120, 7001],
        [4242, 7001, 1733, 5120],
    ]
    assert str(cursor) == "7001" and title.endswith("sorted by memory")


async def test_status_replaces_the_tables_until_nvml_answers_again():
    poller = FakePoller(NO_DRIVER)
    async with WatchApp(poller, refresh=50, host="gpu-box").run_test(size=(100, 30)) as pilot:
        await pilot.pause()
        app = pilot.app
        shown = [app.query_one(s).display for s in ("#status", "#devices", DataTable)]
        status = rendered(app, "#status")
        poller.reading = GPUS
        await pilot.pause(0.1)
        after = [app.query_one(s).display for s in ("#status", "#devices", DataTable)]

    assert shown == [True, False, False] and after == [False, True, True]
    assert "NVML unavailable" in status and "no NVIDIA driver is loaded" in status


async def test_waits_for_the_first_reading_then_renders_each_new_one_once():
    poller = FakePoller(None)
    app = WatchApp(poller, refresh=50, host="gpu-box")
    shown = []
    show = app.show
    app.show = lambda: (shown.append(app.reading), show())
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.pause()
        waiting = rendered(app, "#devices"), rendered(app, "#header")
        poller.reading = GPUS
        await pilot.pause(0.1)  # five pulls of the same object
        shown_once = list(shown)
        newer = GpuReading(
            t=T0 + 60,
            driver="580.159.04",
            devices=(GpuDevice(0, name="H200", processes=(GpuProcess(99, GiB, "compute", "cy", "python serve.py"),)),),
        )
        poller.reading = newer
        await pilot.pause(0.1)
        header, table = rendered(app, "#header"), rows(app)

    assert waiting[0] == "waiting for the first reading…" and "waiting" in waiting[1]
    assert shown_once == [None, GPUS] and shown == [None, GPUS, newer]
    assert "11:07:40" in header and table == [["0", "99", "cy", "1.00 GiB", "compute", "python serve.py"]]


async def test_help_and_quit_keys():
    async with make().run_test(size=(100, 30)) as pilot:
        keys = {b.binding.key for b in pilot.app.screen.active_bindings.values() if b.binding.show}
        await pilot.press("question_mark")
        helped = isinstance(pilot.app.screen, WatchHelp)
        await pilot.press("escape")
        closed = not isinstance(pilot.app.screen, WatchHelp)
        await pilot.press("q")
        await pilot.pause()
        running = pilot.app.is_running

    assert {"q", "s", "question_mark"} <= keys
    assert helped and closed and not running


def test_screen(snap_compare):
    assert snap_compare(make(), terminal_size=(100, 30))


def test_run_screen_says_why_without_starting_the_app(monkeypatch):
    monkeypatch.setattr(watch, "read_gpus", lambda: NO_DRIVER)
    monkeypatch.setattr(WatchApp, "run", lambda self: pytest.fail("the app started"))
    err = io.StringIO()

    assert watch.run_screen(1.0, err) == 1
    assert err.getvalue() == "gputui: no NVIDIA driver is loaded (nvidia-smi would fail too)\n"


def test_run_screen_polls_while_the_app_runs(monkeypatch):
    seen = []

    class Poller(FakePoller):
        def __init__(self, interval):
            super().__init__()
            self.interval, self.running = interval, False

        def __enter__(self):
            self.running = True
            return self

        def __exit__(self, *exc):
            self.running = False

    monkeypatch.setattr(watch, "read_gpus", lambda: GPUS)
    monkeypatch.setattr(watch, "NvmlPoller", Poller)
    monkeypatch.setattr(
        WatchApp, "run", lambda self: seen.append((self.poller.interval, self.poller.running, self.refresh_hz))
    )

    assert watch.run_screen(10.0, io.StringIO()) == 0
    assert watch.run_screen(0.5, io.StringIO()) == 0
    assert seen == [(0.25, True, 10.0), (2.0, True, 0.5)]


async def test_a_reading_while_the_app_shuts_down_draws_nothing():
    """Under run_test Textual's shutdown takes the screens apart while the app still handles its timers: a
    new reading there made show() query widgets that were gone (NoMatches), as the run app's screens did."""
    app = make()
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.pause()
        app._running = False  # what App._shutdown does first, then it removes each screen's widgets
        await app.screen.remove_children()
        app.poller.reading = NO_DRIVER
        app.pull()
