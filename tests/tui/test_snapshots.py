"""The main screens at fixed sizes with a frozen clock, compared with the SVGs in __snapshots__/.

After a deliberate UI change: `pytest tests/tui/test_snapshots.py --snapshot-update`, then look at
the new SVGs before committing them.
"""

import pytest
from fakes import FrozenClock, GiB, cpu_run, cuda_run, own_loop_run, plan_event

from gputui.telemetry.sample import Event
from gputui.tui.app import GputuiApp
from gputui.tui.screens import OomScreen, PlannerScreen

pytestmark = pytest.mark.usefixtures("utc")  # timeline clocks in UTC: stable snapshots


def app(source, script="train.py"):
    return GputuiApp(source, script=script, clock=FrozenClock(), refresh=4)


@pytest.mark.parametrize("size", [(80, 24), (120, 40), (160, 48)])
def test_main_screen_cuda(snap_compare, size):
    assert snap_compare(app(cuda_run()), terminal_size=size)


def test_main_screen_cpu_budget(snap_compare):
    assert snap_compare(app(cpu_run(), script="mlp.py"), terminal_size=(100, 30))


def test_main_screen_own_loop(snap_compare):
    assert snap_compare(app(own_loop_run(), script="own.py"), terminal_size=(120, 40))


def test_oom_dialog(snap_compare):
    source = cuda_run(150)
    source.update.events.append(
        Event(
            "oom",
            150,
            {
                "phase": "forward",
                "micro_batch": 32,
                "waiting": True,
                "message": "CUDA out of memory. Tried to allocate 4.00 GiB. GPU 0 has a total capacity of 79.19 GiB",
            },
            t=1_795_000_150.0,
        )
    )

    async def dialog_shown(pilot):  # the first pull pushes it: wait for it, not for a lucky frame
        for _ in range(100):
            if isinstance(pilot.app.screen, OomScreen):
                break
            await pilot.pause(0.02)
        await pilot.wait_for_scheduled_animations()
        await pilot.pause()

    assert snap_compare(app(source), terminal_size=(100, 30), run_before=dialog_shown)


def test_help_screen(snap_compare):
    assert snap_compare(app(cuda_run()), terminal_size=(100, 30), press=["question_mark"])


def test_planner_screen(snap_compare):
    source = cuda_run()

    async def plan_shown(pilot):  # w asks; the run answers with the table
        await pilot.press("w")
        source.push(events=[plan_event(capacity=20 * GiB, request_id=101)])
        for _ in range(100):
            if isinstance(pilot.app.screen, PlannerScreen) and pilot.app.screen.query_one("#plan-table").row_count:
                break
            await pilot.pause(0.02)
        await pilot.pause()

    assert snap_compare(app(source), terminal_size=(100, 30), run_before=plan_shown)
