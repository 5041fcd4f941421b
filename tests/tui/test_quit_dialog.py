"""The quit dialog says what stopping does to this script: fit() returns (its save runs), an own
loop gets a KeyboardInterrupt."""

from conftest import until
from textual.widgets import Button, Label

from gputui.tui.screens import ConfirmQuit

OWN_LOOP = """
import time, torch
from torch import nn
model = nn.Linear(8, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(100_000):
    loss = model(torch.randn(16, 8)).square().mean()
    opt.zero_grad(); loss.backward(); opt.step()
    time.sleep(0.01)
torch.save(model.state_dict(), "never.pt")
"""


def asked(app):
    assert isinstance(app.screen, ConfirmQuit)
    return str(app.screen.query_one(Label).render())


async def test_an_own_loop_is_told_it_gets_a_keyboard_interrupt(own_loop_app):
    app = own_loop_app(OWN_LOOP)
    async with app.run_test(size=(110, 32)) as pilot:
        await until(pilot, lambda: app.view.latest is not None)
        await pilot.press("q")
        text = asked(app)
        assert "own loop" in text and "KeyboardInterrupt" in text and "does not run" in text
        assert "fit()" not in text and "your save happens" not in text
        await pilot.press("n")


async def test_asked_before_the_run_starts_the_dialog_says_so_then_what_fit_does(make_app, tmp_path):
    go = tmp_path / "go"  # fit starts once the test says: imports, data loading
    ready = f"lambda: __import__('os').path.exists({str(go)!r})"
    app = make_app(extra=f"**{{}} if [time.sleep(0.01) for _ in iter({ready}, True)] else {{}}")
    async with app.run_test(size=(100, 30)) as pilot:
        await until(pilot, lambda: any("script started" in line for line in app.output.lines))
        await pilot.press("q")
        assert asked(app).startswith("Training has not started yet.")
        go.touch()
        await until(pilot, lambda: "your save happens" in asked(app))  # the open dialog follows the run
        assert asked(app).startswith("Training is running. Stop after the current step and quit?")
        await pilot.press("n")


async def test_a_paused_run_is_asked_about_as_paused(make_app, hub):
    app = make_app()
    async with app.run_test(size=(100, 30)) as pilot:
        await until(pilot, lambda: app.view.latest is not None)
        await pilot.press("p")
        await until(pilot, lambda: app.view.paused)
        await pilot.press("q")
        assert asked(app).startswith("Training is paused. Stop it and quit?")
        assert str(app.screen.query_one("#no", Button).label) == "[n] keep it paused"
        await pilot.press("n")
