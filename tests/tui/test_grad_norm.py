"""The gradient norm beside the loss: its figures (the latest, the highest and where, the clip, the fp16
steps skipped) and its own small chart under the loss chart, where a spike shows."""

from dataclasses import replace

from conftest import text, until
from fakes import GPUS, FakeSource, FrozenClock, cuda_run, cuda_sample, info

from gputui.telemetry.sample import Event
from gputui.tui.app import GputuiApp


def norm(step: int) -> float:
    return 9.0 if step == 40 else 0.5 + step / 100


async def test_the_loss_panel_shows_the_norm_its_spike_the_clip_and_the_skipped_steps():
    samples = [replace(cuda_sample(s), grad_norm=norm(s)) for s in range(1, 81)]
    skipped = Event("step_skipped", 31, {"at": 30, "skipped": 1})
    source = FakeSource(samples, [skipped], info("cuda:0", "NVIDIA H100 80GB HBM3", clip_grad_norm=1.0), GPUS)
    app = GputuiApp(source, script="train.py", clock=FrozenClock(), refresh=1)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        lines = text(app, "#loss").splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("grad norm"))
    assert lines[at].split("  ") == ["grad norm 1.3", "max 9 @ 40", "clip 1", "1 fp16 step skipped"]
    chart = lines[at + 1 : -1]  # then its chart, then the steps under both charts
    assert 2 <= len(chart) <= 4 and chart[0].split()[0] == "9" and chart[-1].split()[0] == "0"
    spike = chart[0].index("⢸")  # the one point far above the rest reaches the top row
    assert all(row[spike] != " " for row in chart)
    assert lines[-1].split() == ["step", "1", "80"]


async def test_a_run_without_norms_shows_no_norm_line():
    """An own loop (no norm is measured) or an older job's steps."""
    app = GputuiApp(cuda_run(steps=50), script="train.py", clock=FrozenClock(), refresh=1)
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: "smoothed" in text(app, "#loss"))  # the panel drew the run's steps
        assert "grad norm" not in text(app, "#loss")


async def test_fits_norm_shows_after_steps(make_app, hub):
    app = make_app(extra="clip_grad_norm=1.0")
    async with app.run_test(size=(100, 30)) as pilot:
        await until(pilot, lambda: "grad norm" in text(app, "#loss"))
        assert "clip 1" in text(app, "#loss")
        assert app.view.latest.grad_norm > 0


async def test_a_norm_measured_for_part_of_the_run_is_drawn_under_its_steps_and_said_as_the_last():
    """Measured at steps 41-50 of 80 (fp16's scaler for a while): its chart has points under those steps
    only, not the ten stretched over the run; the figure says the last was measured at step 50."""
    samples = [replace(cuda_sample(s), grad_norm=2.0 if 41 <= s <= 50 else None) for s in range(1, 81)]
    source = FakeSource(samples, [], info("cuda:0", "NVIDIA H100 80GB HBM3"), GPUS)
    app = GputuiApp(source, script="train.py", clock=FrozenClock(), refresh=1)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        lines = text(app, "#loss").splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("grad norm"))
    assert lines[at].split("  ")[0] == "grad norm 2 @ 50"
    chart = lines[at + 1 : -1]
    drawn = [i for i, c in enumerate(chart[0]) if c not in " ⠀" and i > 8]  # past the axis labels
    width = len(lines[-1])
    assert drawn and width * 0.4 < min(drawn) and max(drawn) < width * 0.75, (chart[0], drawn)
