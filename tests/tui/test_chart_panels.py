"""The chart panels on the screen: a new step refreshes the few lines it changed, and the lines kept
from earlier frames are the lines the panel would draw anew."""

import io
from dataclasses import replace

from fakes import GPUS, FrozenClock, cuda_run, cuda_sample, on_refresh
from rich.console import Console

from gputui.telemetry.sample import Event
from gputui.tui.app import GputuiApp
from gputui.tui.panels.base import LinePanel
from gputui.tui.sources import Update


def drawn(app) -> list[str]:
    """The screen as the terminal shows it (styles included), one string a row."""
    console = Console(width=app.size.width, height=app.size.height, file=io.StringIO(), record=True)
    console.print(app.screen._compositor.render_update(full=True))
    return console.export_svg().splitlines()


def refreshed_lines(app) -> dict[str, list[int]]:
    """Each line panel's count of lines asked to repaint, per refresh (a whole refresh: its height)."""
    counts: dict[str, list[int]] = {}

    def note(panel, regions):
        lines = sum(r.height for r in regions) if regions else panel.content_size.height
        counts.setdefault(panel.id, []).append(lines)

    on_refresh(app, LinePanel, note)
    return counts


async def test_a_new_step_refreshes_only_the_lines_it_changed():
    source = cuda_run()
    info = source.update.info
    app = GputuiApp(source, script="train.py", clock=FrozenClock(), refresh=1)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        for step in (301, 302):  # 301: past the right edge of the charts drawn at once, so squeezed
            source.update = Update([cuda_sample(step)], [], info, None, GPUS, runs=1)
            app.pull()
            await pilot.pause()
        counts = refreshed_lines(app)
        source.update = Update([cuda_sample(303)], [], info, None, GPUS, runs=1)
        app.pull()
        heights = {panel.id: panel.content_size.height for panel in app.main.query(LinePanel)}

    assert counts["header"] == [1]
    for panel in ("memory", "loss"):  # figures, the last columns' rows, the axis' last step
        assert len(counts[panel]) == 1 and 0 < counts[panel][0] <= 6 < heights[panel]


async def test_the_lines_kept_from_earlier_frames_are_the_lines_drawn_anew():
    source = cuda_run(150)
    info = source.update.info
    app = GputuiApp(source, script="train.py", clock=FrozenClock(), refresh=1)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        step = 150
        for more in (1, 1, 3, 40, 1, 7, 0, 2):
            source.update = Update(
                [cuda_sample(s) for s in range(step + 1, step + more + 1)], [], info, None, GPUS, runs=1
            )
            step += more
            app.pull()
            await pilot.pause()
        kept = drawn(app)
        for panel in app.main.query(LinePanel):
            panel._made_at = None  # every line made anew
            panel.refresh()
        await pilot.pause()
        anew = drawn(app)

    assert kept == anew


async def test_a_run_that_ended_is_drawn_over_the_whole_width():
    from gputui.telemetry.run import RunSummary
    from gputui.tui.panels.base import ChartPanel

    source = cuda_run()
    app = GputuiApp(source, script="train.py", clock=FrozenClock(), refresh=1)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        source.push([cuda_sample(301)])  # squeezed to make room
        app.pull()
        await pilot.pause()
        full = {panel.id: panel.content_size.width - panel.chart.gutter for panel in app.main.query(ChartPanel)}
        assert all(panel.chart.extent < full[panel.id] for panel in app.main.query(ChartPanel))
        source.update = replace(source.update, summary=RunSummary(steps=301))
        app.pull()
        await pilot.pause()
        assert {panel.id: panel.chart.extent for panel in app.main.query(ChartPanel)} == full


def eval_event(step: int, value: float | None) -> Event:
    details = {"value": value, "batches": 8, "samples": 512, "items": None, "seconds": 1.5, "micro_batch": 32}
    return Event("eval", step, {**details, "ooms": 0})


def eval_columns(chart) -> list[int]:
    """The plot's columns with a dot of the eval line (magenta)."""
    columns = set()
    for row in chart.rows:
        x = -chart.gutter
        for text, style in row:
            if style.color is not None and style.color.name == "magenta":
                columns.update(x + i for i, c in enumerate(text) if c.strip(" \u2800"))
            x += len(text)
    return sorted(columns)


async def test_an_evaluation_is_the_eval_line_on_the_loss_chart_from_its_step():
    from gputui.tui.panels.loss import LossPanel

    source = cuda_run()
    app = GputuiApp(source, script="train.py", clock=FrozenClock(), refresh=1)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        loss = app.main.query_one("#loss", LossPanel)
        assert not eval_columns(loss.chart) and "eval" not in loss.heading.plain
        source.push(events=[eval_event(150, 2.9), eval_event(300, 2.5)])
        app.pull()
        await pilot.pause()
        plot = loss.content_size.width - loss.chart.gutter
        columns = eval_columns(loss.chart)
        title = loss.heading.plain
        source.push([cuda_sample(301)], [eval_event(301, None)])  # a value not finite: said, not drawn
        app.pull()
        await pilot.pause()
        after = loss.heading.plain

    assert "━ raw ━ smoothed ━ eval 2.5" in title  # the last evaluation, in its colour in the legend
    assert columns and abs(columns[0] - plot / 2) <= 2 and columns[-1] == plot - 1  # from step 150 on
    assert after.endswith("━ eval nan")
