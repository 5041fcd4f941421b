"""The script's output as a user reads it: whole lines from their start, progress bars as one line."""

from conftest import text, until
from textual.widgets import RichLog, Static

from gputui.telemetry.output import OutputLog
from gputui.tui.app import GputuiApp
from gputui.tui.screens import LogScreen
from gputui.tui.sources import LocalSource


def test_carriage_return_redraws_one_line_until_its_newline():
    log = OutputLog()
    log.write("epoch 1\n")
    for pct in (10, 50, 100):
        log.write(f"\r{pct:3d}%|{'#' * (pct // 10):<10}|")
    assert log.current == "100%|##########|"
    assert list(log.lines) == ["epoch 1"]  # the bar is not a line yet, and never a pile of blank ones
    log.write("\n")
    assert list(log.lines) == ["epoch 1", "100%|##########|"] and log.current == ""
    log.write("done\r\n")  # a Windows line end is one line end
    assert log.tail(2) == ["100%|##########|", "done"]


def test_a_redraw_ending_in_carriage_return_keeps_what_it_drew():
    log = OutputLog()
    log.write(" 3/10 loss 0.5\r")
    log.write(" 4/10 loss 0.4\r")
    assert log.current == " 4/10 loss 0.4"
    log.write("\n")
    assert log.tail(1) == [" 4/10 loss 0.4"]


def test_escape_sequences_and_controls_are_not_passed_to_the_screen():
    log = OutputLog()
    log.write("\x1b[32mok\x1b[0m \x1b]0;title\x07\x1b[2Kstep\t1\x07\x08\n")
    assert log.tail(1) == ["ok step 1"]  # the tab to column 8


def test_a_bar_that_redraws_forever_keeps_only_its_last_redraw():
    log = OutputLog()
    for i in range(10_000):
        log.write(f"\r{i}")
    assert log.current == "9999" and len(log._partial) < 10


LONG = (
    "{'loss': '6.034', 'grad_norm': '1.25', 'learning_rate': '4.9e-05', 'epoch': '0.12', "
    "'step': 1234, 'tokens_per_second': 9876.5, 'marker': 'END'}"
)
OWN_LOOP = f"""
import sys, time, torch
from torch import nn
model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
print("LINE-START " + {LONG!r})
for step in range(3000):
    loss = nn.functional.cross_entropy(model(torch.randn(16, 8)), torch.randint(2, (16,)))
    opt.zero_grad(); loss.backward(); opt.step()
    sys.stderr.write(f"\\rtraining {{step}}/3000 |{{'#' * (step % 20):<20}}|")
    time.sleep(0.01)
"""


async def test_panel_and_log_screen_show_lines_from_their_start(own_loop_app):
    app = own_loop_app(OWN_LOOP)
    async with app.run_test(size=(100, 32)) as pilot:
        await until(pilot, lambda: app.view.latest is not None and app.view.latest.step >= 3)
        await until(pilot, lambda: "training " in text(app, "#log"))
        panel = text(app, "#log")
        assert "LINE-START {'loss': '6.034'" in panel  # the start, not the end, of a long line
        assert "'marker': 'END'}" in panel  # wrapped onto the next rows, not cut
        assert panel.count("training ") == 1 and "\n\n" not in panel  # one bar, redrawn in place
        await pilot.press("l")
        assert isinstance(app.screen, LogScreen)
        log = app.screen.query_one(RichLog)
        await until(pilot, lambda: any("LINE-START" in line.text for line in log.lines))
        current = app.screen.query_one("#output-current", Static)
        await until(pilot, lambda: "training " in str(current.render()))
        assert not any("training " in line.text for line in log.lines)


async def test_log_screen_says_so_when_nothing_was_printed(hub):
    app = GputuiApp(LocalSource(hub), script="quiet.py", refresh=20)
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.press("l")
        assert isinstance(app.screen, LogScreen)
        note = app.screen.query_one("#output-current", Static)
        await until(pilot, lambda: "printed nothing yet" in str(note.render()))  # once the screen is laid out
        assert note.display
        app.output.write("hello\n")
        app.screen.update()
        await until(pilot, lambda: not note.display)


async def test_log_screen_shows_the_output_of_a_run_that_has_ended(hub):
    app = GputuiApp(LocalSource(hub), script="done.py", refresh=20)  # nothing trains: no pull brings news
    app.output.write("saved the model after step 200\n")
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.press("l")
        log = app.screen.query_one(RichLog)
        await until(pilot, lambda: log.lines)  # written once the log knows its width
        assert [line.text for line in log.lines] == ["saved the model after step 200"]


async def test_the_log_screen_wraps_a_line_at_its_own_width_not_at_80_columns(hub):
    """A 100-character line in a 120-column terminal is one line (textual measured it against an
    80-column console and wrapped it there); a 200-character one wraps at the screen's width."""
    line, longer = "L" * 99 + "|", "M" * 199 + "|"
    hub.output.write(f"{line}\n{longer}\n")
    app = GputuiApp(LocalSource(hub), script="wide.py", refresh=20)
    async with app.run_test(size=(120, 30)) as pilot:
        await pilot.press("l")
        log = app.screen.query_one(RichLog)
        await until(pilot, lambda: len(log.lines) >= 3)
        shown = [strip.text.rstrip() for strip in log.lines]
        assert shown[0] == line and shown[1] + shown[2] == longer and 100 < len(shown[1]) <= 120
