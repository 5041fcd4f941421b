"""Plan events a newer or older peer, or a buggy engine, could send over the attach socket (the client
checks only the top-level types): the timeline, the remedies bar, the planner screen and describe()
skip a malformed row and show "?" for a figure that is not one, and never raise."""

from dataclasses import replace

import pytest
from conftest import text, until
from fakes import GiB, MiB, cuda_run, plan_event
from test_layout import assert_whole, shown
from test_planner import make, rows, screen_text

from gputui.telemetry.describe import describe, plan_lines
from gputui.telemetry.sample import Event
from gputui.tui.planned import fresh, options, predicted
from gputui.tui.screens import PlannerScreen
from gputui.tui.view import RunView

DROP = object()


def rows_with(**changes) -> list[dict]:
    """cuda_run's plan rows (20 GiB capacity), each with `changes`."""
    return [o | changes for o in plan_event(capacity=20 * GiB)["options"]]


def hostile(**details) -> Event:
    """cuda_run's plan (20 GiB capacity) with these top-level details in its stead; a detail of DROP removed."""
    e = plan_event(capacity=20 * GiB)
    merged = {k: v for k, v in (dict(e.details) | details).items() if v is not DROP}
    return replace(e, details=merged)


def each_missing() -> list[dict]:
    """Every row lacks another key; "now" lacks only its breakdown, so the plan stays fresh."""
    options = plan_event(capacity=20 * GiB)["options"]
    drops = [("breakdown",), ("peak",), ("label",), ("micro_batch",), ("remedy",), ("fits", "exact"), ("seconds",)]
    return [{k: v for k, v in o.items() if k not in drop} for o, drop in zip(options, drops, strict=True)]


LONG = "x" * 400

CASES = {
    "rows missing keys": hostile(options=each_missing()),
    "rows not mappings": hostile(options=[1, "row", None, [1, 2], *rows_with()]),
    "options a string": hostile(options="abc"),
    "options a mapping": hostile(options={"key": "b"}),
    "options a number": hostile(options=5),
    "options null": hostile(options=None),
    "capacity null": hostile(capacity=None),
    "capacity zero": hostile(capacity=0),
    "capacity a string": hostile(capacity="big"),
    "peak null": hostile(options=rows_with(peak=None)),
    "peak a string": hostile(options=rows_with(peak="big")),
    "negative correction": hostile(correction=-300 * MiB),
    "correction null": hostile(correction=None, measured="x"),
    "fits null": hostile(options=rows_with(fits=None)),
    "fits a string": hostile(options=rows_with(fits="yes")),
    "unknown remedies": hostile(options=rows_with(remedy="quantize", key="q")),
    "unhashable values": hostile(trigger=[1], options=rows_with(remedy=[1], key=[2], fits=[3], label=None)),
    "huge numbers": hostile(
        capacity=1e30, correction=1e30, measured=1e30, options=rows_with(peak=1e30, predicted=1e30)
    ),
    "long text": hostile(trigger=LONG, options=rows_with(label=LONG, reason=LONG, phase=LONG, exact=False)),
    "odd breakdowns": hostile(options=rows_with(breakdown=[1, 2], seconds="slow", predicted=None)),
    "odd breakdown sizes": hostile(options=rows_with(breakdown={"activations": "x", "temporaries": None})),
    "complete missing": hostile(complete=DROP),
    "complete null": hostile(complete=None),
}


@pytest.mark.parametrize("event", CASES.values(), ids=CASES.keys())
def test_describe_and_plan_lines_never_raise(event):
    assert describe(event).startswith("plan")
    assert all(isinstance(line, str) for line in plan_lines(event))


def test_a_malformed_row_is_skipped_and_a_figure_that_is_not_one_shown_as_a_question_mark():
    assert describe(CASES["rows not mappings"]).startswith("plan (7 options); now 14.1 GiB of 20.0 GiB")
    assert len(plan_lines(CASES["rows not mappings"])) == 8  # the 7 rows and the correction
    assert describe(CASES["options a string"]) == "plan: no remedy applies" and plan_lines(CASES["options null"]) == [
        "  (each includes a correction of 300 MiB measured on the setting in use)"
    ]
    assert describe(CASES["peak null"]) == "plan (7 options); now ? of 20.0 GiB; best 64x1 ckpt: ?"
    assert "?" in plan_lines(CASES["peak a string"])[0] and "   -" in plan_lines(CASES["peak a string"])[0]
    assert "now 14.1 GiB;" in describe(CASES["capacity a string"])  # no "of" a capacity that is not one
    assert "correction of -300 MiB" in plan_lines(CASES["negative correction"])[-1]
    assert all("fits" not in line for line in plan_lines(CASES["fits a string"]))
    assert describe(CASES["complete missing"]) == "plan"  # without a detail its name promises: named only


def test_the_view_skips_malformed_rows_before_and_after_a_step():
    v = RunView()
    v._event(CASES["rows missing keys"])  # before any step sample
    assert not fresh(v) and predicted(v, "b") is None and len(options(v)) == 7
    for event in CASES.values():  # no step yet: no plan is fresh, whatever its rows, so no key predicts
        v._event(event)
        assert predicted(v, "b") is None and not fresh(v)
    assert len(v.timeline) >= 1 and v.plans == len(CASES) + 1


async def open_planner(app, pilot) -> None:
    await pilot.press("w")
    await until(pilot, lambda: isinstance(app.screen, PlannerScreen))


@pytest.mark.parametrize("size", [(80, 24), (120, 40)])
async def test_the_planner_and_remedies_bar_show_every_hostile_plan(size):
    """Each case in turn on one app: the table, its detail, the remedies bar and the timeline drawn."""
    source = cuda_run()
    app = make(source)
    async with app.run_test(size=size) as pilot:
        await until(pilot, lambda: app.view.samples_seen > 0)
        await open_planner(app, pilot)
        for n, (name, event) in enumerate(CASES.items(), start=1):
            source.push(events=[event])
            await until(pilot, lambda n=n: app.view.plans == n)
            # The cursor stays on its row across plans: it walks down the rows and back up, so the cases'
            # breakdowns are drawn from every row (press waits for the key's work)
            await pilot.press("down" if (n // 6) % 2 == 0 else "up")
            shown_text = screen_text(app)
            assert f"Plan at step {event.step}" in shown_text, name
            assert len(rows(app)) == len(options(app.view)), name
            text(app, "#remedies")
        assert app.return_code is None  # nothing raised: the app still runs
        await pilot.press("w")
        await until(pilot, lambda: app.screen is app.main)


async def test_the_table_shows_a_question_mark_where_a_row_lacks_a_figure():
    source = cuda_run()
    source.push(events=[CASES["rows missing keys"]])
    app = make(source)
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: app.view.plan is not None)
        await pilot.pause(0.1)
        line = text(app, "#remedies")
        assert "b 16×4 ? ✓" in line and "B 64×1 27.9G ✗" in line, line  # b's row without a peak: "?"
        assert "a fp16" not in line, line  # fp16's row has no key: no prediction for a
        assert "c on ~6.30G" in line and "c on ~6.30G ✓" not in line, line  # no "exact", no "fits"
        await open_planner(app, pilot)
        await until(pilot, lambda: len(rows(app)) == 7)
        table = rows(app)
        assert table[0][5] == "14.1 GiB" and "no breakdown" in screen_text(app)
        assert table[1][5] == "?" and table[1][6] == "– ✓"
        assert table[2][1] == "?" and table[3][2] == "? × 2" and table[4][0] == ""
        assert table[5][5] == "~6.30 GiB" and table[5][6] == "31%" and table[5][8] == "approx"
        for _ in range(6):
            await pilot.press("down")
        await until(pilot, lambda: "predicted in ? s" in screen_text(app))


async def test_a_plan_before_any_step():
    source = cuda_run(steps=0)
    source.push(events=[CASES["rows missing keys"]])
    app = make(source)
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: app.view.plan is not None)
        await pilot.pause(0.1)
        assert "16×4" not in text(app, "#remedies")  # no step: no settings the plan was made for
        await open_planner(app, pilot)
        await until(pilot, lambda: len(rows(app)) == 7)
        assert "Plan at step 300" in screen_text(app) and "stale" not in screen_text(app)


@pytest.mark.parametrize("name", ["huge numbers", "long text"])
@pytest.mark.parametrize("size", [(80, 24), (120, 40)])
async def test_odd_figures_keep_the_main_screen_whole(name, size):
    source = cuda_run()
    source.push(events=[CASES[name]])
    screen = await shown(source, size)
    assert "? help" in screen["footer"] and "q quit" in screen["footer"], screen["footer"]
    assert "[o] auto" in screen["remedies"]
    if name == "long text":
        assert_whole(screen)
