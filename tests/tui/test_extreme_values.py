"""A job's figures reach the screen as sent (over the socket, checked for type, not for sense): values no
training produces must still draw, not end the app with a traceback."""

from dataclasses import replace

from fakes import FrozenClock, cuda_run, cuda_sample

from gputui.telemetry.sample import Event, RankMemory
from gputui.tui.app import GputuiApp


def absurd(step: int, loss: float):
    sample = cuda_sample(step, ranks=2)
    return replace(
        sample,
        loss=loss,
        amp="xyz",  # a mode this gputui does not know (a newer job's)
        batch_size=2**62,
        samples_per_s=5e-324,  # the time left: 2**62 x the steps left / 5e-324 s is no duration
        memory=replace(sample.memory, peak=1e308, capacity=0.5, allocated=-(2**63)),
        ranks=(RankMemory(0, 8, 1e308, 0.5, 1e308, 1e-300, 2**63), RankMemory(1, 8, -1.0, 0.5)),
        grad_norm=-loss,
    )


async def test_absurd_figures_from_a_job_draw_and_the_keys_still_act():
    source = cuda_run(steps=20, ranks=2)
    app = GputuiApp(source, script="train.py", clock=FrozenClock(), refresh=1)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        skipped = Event("step_skipped", 22, {"at": "?", "skipped": "many"})  # only describe() needs to work
        source.push([absurd(21, 1e308), absurd(22, -1e308)], [skipped, Event("paused", 22, {}, t=1e308)])
        app.pull()
        await pilot.pause()
        header = app.screen.query_one("HeaderBar").render_line(0).text
        assert "step 22/1000" in header and "ETA" not in header
        assert "--:--:--" in app.screen.query_one("Timeline").render().renderables[0].plain
        await pilot.press("a")
        await pilot.pause()
        assert source.sent == [("set_amp", "off")], "an unknown mode steps to the first"
