"""A script that never imports torch runs no training: once it ends, the screen says finished or
failed (never "starting"), and what it printed is on the log screen."""

from conftest import until
from test_layout import region
from textual.widgets import RichLog

from gputui.tui.screens import FailureScreen, LogScreen


async def test_a_script_without_torch_ends_as_finished(own_loop_app, hub):
    app = own_loop_app('print("hi from a script without torch")\n')
    async with app.run_test(size=(100, 30)) as pilot:
        await until(pilot, lambda: app.view.exit_code is not None)
        await pilot.pause(0.2)
        header = region(app, "#header")
        assert "│ finished" in header and "starting" not in header, header
        assert "no training step: the script ended" in region(app, "#memory")
        await pilot.press("l")
        assert isinstance(app.screen, LogScreen)
        log = app.screen.query_one(RichLog)
        await until(pilot, lambda: any("hi from a script without torch" in line.text for line in log.lines))
        await pilot.press("escape", "q")
        await until(pilot, lambda: app.return_value is not None)
    assert app.return_value == 0


async def test_a_failing_script_without_torch_ends_as_failed(own_loop_app, hub):
    app = own_loop_app('print("about to fail")\nraise SystemExit(3)\n')
    async with app.run_test(size=(100, 30)) as pilot:
        await until(pilot, lambda: isinstance(app.screen, FailureScreen))
        await pilot.press("escape")
        await pilot.pause(0.2)
        header = region(app, "#header")
        assert "│ failed" in header and "starting" not in header, header
        assert app.view.exit_code == 3
