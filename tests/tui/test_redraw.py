"""Panels redraw only when what they show changed: a pull with nothing new re-renders nothing."""

from collections import Counter
from dataclasses import replace

from fakes import GPUS, FrozenClock, cuda_run, cuda_sample, on_refresh

from gputui.telemetry.sample import Event
from gputui.tui.app import GputuiApp
from gputui.tui.panels.base import Panel
from gputui.tui.sources import Update


def count_refreshes(app: GputuiApp) -> Counter:
    counts: Counter = Counter()
    on_refresh(app, Panel, lambda panel, regions: counts.update([panel.id]))
    return counts


async def test_a_pull_redraws_the_panels_whose_data_changed():
    source = cuda_run()
    info = source.update.info
    app = GputuiApp(source, script="train.py", clock=FrozenClock(), refresh=1)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        app.pull()  # the header's key as laid out (it was first taken before the screen had its width)
        counts = count_refreshes(app)
        for _ in range(3):
            app.pull()  # training, nothing new: the frozen clock keeps even the elapsed time still
        nothing = dict(counts)
        source.update = Update([cuda_sample(301)], [], info, None, GPUS, runs=1)
        app.pull()
        step = dict(counts)
        counts.clear()
        source.update = Update([], [Event("paused", 301, {})], info, None, GPUS, runs=1)
        app.pull()
        event = dict(counts)

    assert nothing == {}
    assert step == {"header": 1, "memory": 1, "loss": 1}  # same batch, same GPUs, no event
    assert event == {"header": 1, "timeline": 1}  # "paused" in the header, a line in the timeline


async def test_the_ranks_panel_redraws_when_a_rank_it_shows_changed():
    source = cuda_run(ranks=64, rank=3, world_size=64)
    info = source.update.info
    app = GputuiApp(source, script="ddp.py", clock=FrozenClock(), refresh=1)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        app.pull()
        counts = count_refreshes(app)
        for _ in range(3):
            app.pull()
        nothing = dict(counts)
        last = cuda_sample(300, 64)
        shown = app.view.ranks(5)
        hidden = [r for r in last.ranks if r not in shown.shown and r != shown.hidden_worst]
        moved = replace(
            last, step=301, ranks=tuple(replace(r, peak=r.peak - 1) if r in hidden else r for r in last.ranks)
        )
        source.update = Update([moved], [], info, None, GPUS, runs=1)
        app.pull()
        unseen = dict(counts)  # ranks it neither shows nor names in its note moved
        counts.clear()
        source.update = Update([cuda_sample(302, 64)], [], info, None, GPUS, runs=1)
        app.pull()
        seen = dict(counts)

    assert nothing == {}
    assert unseen == {"header": 1, "memory": 1, "loss": 1}  # a new step: no rank the panel shows moved
    assert seen == {"header": 1, "memory": 1, "loss": 1, "ranks": 1}
