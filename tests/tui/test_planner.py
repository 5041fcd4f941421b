"""The what-if planner on screen: the predictions beside the remedy keys, the planner screen (w),
watch-only attach, the timeline's one line a table, and the OOM dialog's predictions. Driven by
fakes.py's scripted source."""

from dataclasses import replace

import pytest
from conftest import text, until
from fakes import T0, FrozenClock, GiB, cuda_run, cuda_sample, plan_event, plan_option
from test_layout import assert_whole, shown
from textual.widgets import Static

from gputui.telemetry.sample import Event
from gputui.tui.app import GputuiApp
from gputui.tui.planned import fresh, pieces, predicted
from gputui.tui.remote import WATCH_ONLY
from gputui.tui.screens import OomScreen, PlannerScreen
from gputui.tui.screens.planner import plan_cells
from gputui.tui.view import RunView


def make(source) -> GputuiApp:
    return GputuiApp(source, script="train.py", clock=FrozenClock(), refresh=30)


def screen_text(app) -> str:
    """The planner's status lines, calibration, table rows and detail, as plain text."""
    screen = app.screen
    assert isinstance(screen, PlannerScreen)
    parts = [str(screen.query_one(f"#{name}").render()) for name in ("plan-status", "plan-calibration", "plan-detail")]
    table = screen.query_one("#plan-table")
    rows = [" | ".join(cell.plain for cell in table.get_row_at(i)) for i in range(table.row_count)]
    return "\n".join(parts + rows)


def rows(app) -> list[list[str]]:
    table = app.screen.query_one("#plan-table")
    return [[cell.plain for cell in table.get_row_at(i)] for i in range(table.row_count)]


async def test_w_asks_for_a_plan_and_shows_its_rows_as_they_come():
    source = cuda_run()
    app = make(source)
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: app.view.samples_seen > 0)
        await pilot.press("w")
        await until(pilot, lambda: isinstance(app.screen, PlannerScreen))
        await until(pilot, lambda: source.sent == [("plan", None)])
        await until(pilot, lambda: "planning…" in screen_text(app))
        assert rows(app) == []
        source.push(events=[plan_event(capacity=20 * GiB, complete=False, rows=3, request_id=101)])
        await until(pilot, lambda: len(rows(app)) == 3)
        assert "more rows come" in screen_text(app)
        source.push(events=[plan_event(capacity=20 * GiB)])
        await until(pilot, lambda: len(rows(app)) == 7)
        shown_text = screen_text(app)
        assert "planning" not in shown_text
        assert "Plan at step 300 (asked for) · capacity 20.0 GiB" in shown_text
        assert "measured 14.1 GiB vs predicted 13.8 GiB as now" in shown_text and "+300 MiB added" in shown_text
        table = {row[1]: row for row in rows(app)}
        assert table["micro-batch 16x4"] == [
            "b", "micro-batch 16x4", "16 × 4", "bf16", "off", "8.20 GiB", "41% ✓", "backward", "exact",
        ]  # fmt: skip
        assert table["micro-batch 64x1"][0] == "B" and table["micro-batch 64x1"][6] == "139% ✗"
        fp16 = table["AMP fp16"]
        assert fp16[5] == "~14.3 GiB" and fp16[-1] == "approx: fp16 estimated from the measured activations"
        assert table["best fit: 64x1 ckpt"][7] == "optimizer"
        assert "as now: parameters 512 MiB · gradients 512 MiB" in shown_text  # the highlighted row's breakdown
        await pilot.press("down")
        await until(pilot, lambda: "micro-batch 16x4: parameters" in screen_text(app))
        await pilot.press("r")  # asks again
        await until(pilot, lambda: source.sent == [("plan", None)] * 2)
        await until(pilot, lambda: "planning again" in screen_text(app))
        await pilot.press("w")
        await until(pilot, lambda: app.screen is app.main)
    plans = [entry for entry in app.view.timeline if entry.text.startswith(("plan", "✓ plan"))]
    assert len(plans) == 1 and "plan (7 options)" in plans[0].text  # the table that came in twice: one line
    assert plans[0].kind == "applied"  # it answers the request (the first part said so)


async def test_the_palette_lists_the_planner():
    app = make(cuda_run())
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: app.view.samples_seen > 0)
        assert "plan (w)" in [name for _, name, _ in app.palette()]
        await app.act("plan")
        await until(pilot, lambda: isinstance(app.screen, PlannerScreen))


@pytest.mark.parametrize("width", [80, 120])
async def test_the_remedies_line_shows_each_keys_prediction_until_the_settings_change(width):
    source = cuda_run()
    source.push(events=[plan_event(capacity=20 * GiB)])
    app = make(source)
    async with app.run_test(size=(width, 40)) as pilot:
        await until(pilot, lambda: app.view.plan is not None)
        await pilot.pause(0.1)
        line = text(app, "#remedies")
        size = (lambda long, short: long) if width >= 120 else (lambda long, short: short)
        for expected in (
            f"b 16×4 {size('8.20 GiB', '8.20G')} ✓",
            f"B 64×1 {size('27.9 GiB', '27.9G')} ✗",
            f"a fp16 ~{size('14.3 GiB', '14.3G')} ✓",  # a goes bf16 -> fp16: that row, not AMP off's
            f"c on {size('6.30 GiB', '6.30G')} ✓",
        ):
            assert expected in line, line
        assert "22.5" not in line
        source.push(samples=[replace(cuda_sample(301), micro_batch=16, accumulation=4)])  # b was pressed
        await until(pilot, lambda: app.view.latest.micro_batch == 16)
        await pilot.pause(0.1)
        line = text(app, "#remedies")
        assert "✓" not in line and "✗" not in line and "8.20" not in line, line  # stale: not shown as current


async def test_no_fit_mark_where_the_capacity_is_unknown():
    source = cuda_run()
    source.push(events=[plan_event(capacity=None)])
    app = make(source)
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: app.view.plan is not None)
        await pilot.pause(0.1)
        line = text(app, "#remedies")
        assert "b 16×4 8.20G  B 64×1 27.9G" in line and "✓" not in line and "✗" not in line, line
        await pilot.press("w")
        await until(pilot, lambda: len(rows(app)) == 7)
        assert "capacity unknown" in screen_text(app) and {row[6] for row in rows(app)} == {"–"}


async def test_watch_only_shows_the_latest_plan_but_cannot_ask():
    source = cuda_run()
    source.watch_only = WATCH_ONLY
    source.push(events=[plan_event(capacity=20 * GiB)])
    app = make(source)
    said: list[str] = []
    app.notify = lambda message, **_: said.append(message)  # type: ignore[method-assign]
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: app.view.plan is not None)
        assert app.why_not("plan") is None  # the screen opens: it shows what the job sent
        await pilot.press("w")
        await until(pilot, lambda: len(rows(app)) == 7)
        shown_text = screen_text(app)
        assert f"shows the run's latest plan but cannot ask for one: {WATCH_ONLY}" in shown_text
        assert "planning" not in shown_text
        assert "r" not in app.active_bindings  # not offered: this screen can never ask
        await pilot.press("r")
        await pilot.pause(0.1)
        assert said == [] and source.sent == []
        line = text(app, "#remedies")
        assert "b 16×4 8.20 GiB ✓" in line  # the predictions are the job's: shown, the keys dimmed


async def test_a_stale_plan_is_dimmed_and_said_so():
    source = cuda_run()
    source.push(events=[plan_event(capacity=20 * GiB)])
    app = make(source)
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: app.view.plan is not None)
        await pilot.press("w")
        await until(pilot, lambda: len(rows(app)) == 7)
        source.push(samples=[replace(cuda_sample(301), checkpointing=True)])
        await until(pilot, lambda: "stale" in screen_text(app))
        assert "checkpointing on" in screen_text(app)
        table = app.screen.query_one("#plan-table")
        assert all(str(cell.style) == "dim" for cell in table.get_row_at(1))


async def test_an_own_loop_says_why_it_cannot_plan():
    source = cuda_run(mode="observe", refused={"plan": "the script runs its own loop: this needs gputui.fit"})
    app = make(source)
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: app.view.samples_seen > 0)
        await pilot.press("w")
        await until(pilot, lambda: isinstance(app.screen, PlannerScreen))
        await pilot.pause(0.1)
        assert "No plan from the run yet." in screen_text(app)
        assert "cannot ask for one: the script runs its own loop" in screen_text(app)
        assert source.sent == []


@pytest.mark.parametrize("size", [(80, 24), (120, 40)])
async def test_predictions_keep_the_main_screen_whole(size):
    source = cuda_run()
    source.push(events=[plan_event(capacity=20 * GiB)])
    screen = await shown(source, size)
    assert_whole(screen)
    assert "b 16×4" in screen["remedies"] and "c on" in screen["remedies"]
    assert "[o] auto" in screen["remedies"]  # the last entry still on the bar


def test_predicted_follows_the_settings_in_force():
    v = RunView()
    v._sample(cuda_sample(300))  # micro-batch 32 x 2, bf16
    assert predicted(v, "b") is None and not fresh(v)
    v._event(plan_event())
    assert fresh(v)
    assert predicted(v, "b")["micro_batch"] == 16 and predicted(v, "B")["micro_batch"] == 64
    assert predicted(v, "a")["amp"] == "fp16" and predicted(v, "c")["checkpointing"]
    v._sample(replace(cuda_sample(301), amp="fp16"))
    assert not fresh(v) and predicted(v, "a") is None


def test_an_uneven_cut_is_shown_as_its_pieces_add_up():
    """64 in micro-batches of 9 is seven pieces, the last of 1: "9 × 7" would read as 63, "9 × 8" as 72."""
    row = plan_option("best", "9x7+1", 9, "bf16", False, int(12 * GiB), 20 * GiB, accumulation=8)
    assert plan_cells(row, 20 * GiB, stale=False)[2].plain == "9 × 7 + 1"
    assert pieces(row, compact=True) == "9×7+1"  # the remedies line's chip
    older = {k: v for k, v in row.items() if k != "batch_size"}  # a plan from a gputui that did not send it
    assert pieces(older) == "9 × 8"


def test_a_plan_in_parts_is_one_timeline_line_and_a_new_one_another():
    v = RunView()
    v._event(plan_event(complete=False, rows=2))
    v._event(plan_event(complete=False, rows=4))
    v._event(plan_event())
    assert [e.text for e in v.timeline] == ["plan (7 options); now 14.1 GiB of 80.0 GiB; best 64x1 ckpt: 11.9 GiB"]
    v._event(plan_event(step=400))  # another table (near capacity, say): its own line
    assert len(v.timeline) == 2 and v.entries == 4


def oom_waiting(step=300, **details) -> Event:
    """cuda_run's step after `step` ran out of memory, auto-recover off: the run waits for the user."""
    fields = {"phase": "forward", "micro_batch": 32, "waiting": True, "recovered": False, "message": "CUDA OOM"}
    return Event("oom", step, fields | details, t=T0 + step)


def dialog_text(app) -> str:
    return str(app.screen.query_one("#oom-plan", Static).render())


async def test_the_oom_dialog_shows_each_remedys_predicted_peak_once_the_run_has_planned():
    source = cuda_run()
    source.push(events=[oom_waiting(planning=True)])
    app = make(source)
    async with app.run_test(size=(100, 30)) as pilot:
        await until(pilot, lambda: isinstance(app.screen, OomScreen))
        assert "planning…" in dialog_text(app)
        source.push(events=[plan_event(capacity=20 * GiB, trigger="oom")])
        await until(pilot, lambda: "Predicted step peak" in dialog_text(app))
        assert dialog_text(app).replace("\n", " ") == (
            "Predicted step peaks (capacity 20.0 GiB): [b] 16 × 4 8.20 GiB ✓ · [c] ckpt 6.30 GiB ✓ · "
            "[r] as is 14.1 GiB ✓ · best fit 64x1 ckpt 11.9 GiB ✓"
        )  # no [a] bf16: the run is on bf16 already


async def test_the_oom_dialog_says_how_to_ask_for_predictions_when_the_run_does_not_plan_by_itself():
    source = cuda_run()
    source.push(events=[plan_event(step=200, capacity=20 * GiB), oom_waiting(planning=False)])  # a plan from before
    app = make(source)
    async with app.run_test(size=(100, 30)) as pilot:
        await until(pilot, lambda: isinstance(app.screen, OomScreen))
        await pilot.pause(0.1)
        assert dialog_text(app) == "Escape, then w: the step peak the planner predicts for each remedy."
