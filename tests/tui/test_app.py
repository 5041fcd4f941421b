"""The real app on a real training script: keys change what the engine does and what the screen shows."""

import pytest
import torch
from conftest import text, until
from fakes import OWN_LOOP
from textual.command import CommandList, CommandPalette
from textual.widgets import Input, RichLog

from gputui.tui.app import ScriptEnded
from gputui.tui.screens import ConfirmQuit, FailureScreen, LogScreen, OomScreen, TopTensorsScreen


def names(hub):
    return [e.name for e in hub.events()]


async def started(pilot, app, hub, steps=2):
    await until(pilot, lambda: app.view.latest is not None and app.view.latest.step >= steps)


async def test_halve_key_reaches_the_engine_and_the_screen(make_app, hub):
    app = make_app(batch=16)
    async with app.run_test(size=(100, 30)) as pilot:
        await started(pilot, app, hub)
        assert "micro-batch 16 × 1 = 16" in text(app, "#remedies")
        await pilot.press("b")
        assert "requested: halve micro-batch (16 -> 8)" in text(app, "#timeline")
        titles = [command.title for command in app.get_system_commands(app.screen)]
        assert "Quit" not in titles and "Theme" in titles  # ours, "quit (q)", asks first: Textual's would not say
        await until(pilot, lambda: "micro_batch_changed" in names(hub))
        await until(pilot, lambda: "micro-batch 8 × 2 = 16" in text(app, "#remedies"))
        timeline = text(app, "#timeline")
        assert "✓ micro-batch 16 -> 8 (accumulation 2) · applied after step" in timeline
        assert timeline.index("✓ micro-batch") < timeline.index("requested")  # newest first


async def test_palette_command_does_what_its_key_does(make_app, hub):
    app = make_app(batch=16)
    async with app.run_test(size=(100, 30)) as pilot:
        await started(pilot, app, hub)
        await pilot.press("ctrl+p")
        await until(pilot, lambda: isinstance(app.screen, CommandPalette))
        app.screen.query_one(Input).value = "halve"  # typed at once: Pilot waits for idle after each key
        await until(pilot, lambda: app.screen.query_one(CommandList).option_count)  # searched in a worker
        await pilot.press("enter")
        await until(pilot, lambda: "micro_batch_changed" in names(hub))
        await until(pilot, lambda: "micro-batch 8 × 2 = 16" in text(app, "#remedies"))
        assert "requested: halve micro-batch (16 -> 8)" in text(app, "#timeline")


async def test_log_screen_shows_what_the_script_printed(make_app, hub):
    app = make_app()
    async with app.run_test(size=(100, 30)) as pilot:
        await started(pilot, app, hub)
        await pilot.press("l")
        assert isinstance(app.screen, LogScreen)
        log = app.screen.query_one(RichLog)
        await until(pilot, lambda: any("script started" in line.text for line in log.lines))
        assert log.display and log.region.height > 1  # on the screen, not merely written
        await pilot.press("l")
        assert not isinstance(app.screen, LogScreen)


@pytest.mark.parametrize(
    "key, event, shown",
    [
        ("a", "amp_changed", "AMP bf16"),
        ("c", "checkpointing_changed", "checkpointing on"),
        ("o", "auto_recover_changed", "auto-recover off"),
        ("f", "cache_freed", "memory freed: RSS"),
    ],
)
async def test_remedy_keys(make_app, hub, monkeypatch, key, event, shown):
    """Each remedy key sends its control, the engine applies it, and the screen says so."""
    app = make_app()
    sent, request = [], hub.controls.request
    monkeypatch.setattr(
        hub.controls, "request", lambda *args, **kwargs: sent.append(request(*args, **kwargs)) or sent[-1]
    )
    async with app.run_test(size=(120, 30)) as pilot:
        await started(pilot, app, hub)
        await pilot.press(key)
        assert "→ requested:" in text(app, "#timeline")  # at once, before the loop answers
        await until(pilot, lambda: event in names(hub))
        answer = next(e for e in hub.events() if e.name == event)
        await until(pilot, lambda: not app.view.pending)  # the answer reached the view
        timeline = text(app, "#timeline")
        assert answer["source"] == "tui" and [c.id for c in sent] == [answer["request_id"]]  # the key's request
        assert shown in text(app, "#remedies") + timeline, timeline
        assert "applied after step" in timeline


async def test_a_key_pressed_again_before_the_loop_answers_counts_on_from_the_first(make_app, hub, monkeypatch):
    """b b halves 16 -> 8 -> 4, a a is off -> bf16 -> fp16 and c c is on then off, though the screen still
    shows the setting before them (the loop applies requests at the next step boundary): each press counts
    from the one before it, not from what the screen showed. Held here: none is applied, so every press
    comes before an answer."""
    from gputui.telemetry.controls import Control

    def held(action, value=None, **kwargs):
        sent.append((action, value))
        return Control(action, value, "tui")

    app = make_app()
    sent = []
    async with app.run_test(size=(120, 30)) as pilot:
        await started(pilot, app, hub)
        with monkeypatch.context() as patched:  # undone before the fixture's stop, which must reach the loop
            patched.setattr(hub.controls, "request", held)
            for key in "bbaaaccoopp":
                await pilot.press(key)
            halvings = [text for text in app.view.pending.values() if text.startswith("halve")]
    assert halvings == ["halve micro-batch (16 -> 8)", "halve micro-batch (8 -> 4)"]
    assert sent == [
        ("halve_batch", None),
        ("halve_batch", None),
        ("set_amp", "bf16"),
        ("set_amp", "fp16"),
        ("set_amp", "off"),
        ("set_checkpointing", True),
        ("set_checkpointing", False),
        ("set_auto_recover", False),
        ("set_auto_recover", True),
        ("pause", None),
        ("resume", None),
    ]


async def test_pause_stops_the_steps_and_resume_restarts_them(make_app, hub):
    app = make_app()
    async with app.run_test(size=(100, 30)) as pilot:
        await started(pilot, app, hub)
        await pilot.press("p")
        await until(pilot, lambda: "paused" in names(hub))
        await until(pilot, lambda: "│ paused" in text(app, "#header"))
        assert "samples/s" not in text(app, "#header") and "ETA" not in text(app, "#header")  # nothing trains
        step = hub.latest().step
        await pilot.pause(0.3)
        assert hub.latest().step == step
        await pilot.press("p")
        await until(pilot, lambda: hub.latest().step > step)
        await until(pilot, lambda: "│ training" in text(app, "#header"))  # at the screen's next refresh


async def test_dimmed_key_does_nothing_and_says_why(make_app, hub):
    app = make_app(batch=1)
    said = []
    notify = app.notify
    app.notify = lambda message, **kw: (said.append(message), notify(message, **kw))
    async with app.run_test(size=(100, 30)) as pilot:
        await started(pilot, app, hub)
        assert app.check_action("halve_batch", ()) is None  # dimmed in the footer
        await pilot.press("b")
        await pilot.press("s")  # snapshots are CUDA-only: dimmed on this CPU run
        await pilot.pause(0.3)
        assert not [e for e in hub.events() if e.name in ("micro_batch_changed", "control_refused")]
        assert said[0] == "the micro-batch is already 1"
        assert said[1].startswith("memory snapshots are a CUDA allocator feature")  # the run's own reason


async def test_quit_asks_once_then_stops_after_the_step_and_the_script_saves(make_app, hub, tmp_path):
    app = make_app()
    async with app.run_test(size=(100, 30)) as pilot:
        await started(pilot, app, hub)
        await pilot.press("q")
        assert isinstance(app.screen, ConfirmQuit)
        await pilot.press("y")
        await until(pilot, lambda: app.return_value is not None)
    assert app.return_value == 0
    assert "stopped" in names(hub)
    assert torch.load(tmp_path / "saved.pt")["steps"] == hub.latest().step
    assert any("saved after" in line for line in app.output.lines)


async def test_quit_before_fit_starts_stops_the_run_at_its_first_boundary(make_app, hub, tmp_path):
    # fit starts late (imports, data loading): once the stop is asked, whenever the test gets to it
    asked = "lambda: len(__import__('gputui.telemetry.hub').telemetry.hub.current().controls) > 0"
    app = make_app(extra=f"**{{}} if [time.sleep(0.01) for _ in iter({asked}, True)] else {{}}")
    async with app.run_test(size=(100, 30)) as pilot:
        await until(pilot, lambda: any("script started" in line for line in app.output.lines))
        assert app.view.info is None
        await pilot.press("q")
        assert isinstance(app.screen, ConfirmQuit)
        await pilot.press("y")
        await until(pilot, lambda: app.return_value is not None)
    assert app.return_value == 0
    assert torch.load(tmp_path / "saved.pt")["steps"] == 0  # stopped at the first boundary, then saved


async def test_a_failing_script_leaves_the_app_up_with_its_traceback(make_app, hub):
    app = make_app(fail="if len(calls) > 4: raise ValueError('bad label')")
    async with app.run_test(size=(100, 30)) as pilot:
        await until(pilot, lambda: isinstance(app.screen, FailureScreen))
        assert app.view.exit_code == 1 and "ValueError: bad label" in app.view.failure
        assert "│ failed" in text(app, "#header")
        await pilot.press("escape")
        assert "error: ValueError: bad label" in text(app, "#timeline")
        await pilot.press("q")
        await until(pilot, lambda: app.return_value is not None)
    assert app.return_value == 1


async def test_the_failure_screen_keys_do_what_it_says(make_app, hub):
    app = make_app(fail="if len(calls) > 4: raise ValueError('bad label')")
    async with app.run_test(size=(100, 30)) as pilot:
        await until(pilot, lambda: isinstance(app.screen, FailureScreen))
        await pilot.press("l")
        assert isinstance(app.screen, LogScreen)
        await pilot.press("escape")
        assert isinstance(app.screen, FailureScreen)
        await pilot.press("q")  # "q quits with its exit code"
        await until(pilot, lambda: app.return_value is not None)
    assert app.return_value == 1


async def test_oom_dialog_when_auto_recover_is_off(make_app, hub):
    app = make_app(batch=64, extra="auto_recover=False, memory_budget='40KiB'")
    async with app.run_test(size=(100, 30)) as pilot:
        await until(pilot, lambda: isinstance(app.screen, OomScreen))
        assert "OOM: waiting" in text(app, "#header")
        # the run plans while it waits: each remedy's predicted step peak comes into the dialog
        await until(pilot, lambda: "[b] 32 × 2" in "".join(str(w.render()) for w in app.screen.query("#oom-plan")))
        await pilot.press("q")  # as on the main screen: it asks (it was ignored here)
        await until(pilot, lambda: isinstance(app.screen, ConfirmQuit))
        await pilot.press("n")
        await until(pilot, lambda: isinstance(app.screen, OomScreen))
        await pilot.press("b")
        await until(pilot, lambda: "resumed" in names(hub))
        assert [e for e in hub.events() if e.name == "micro_batch_changed"][0]["to"] == 32


def test_the_oom_dialog_asked_to_update_before_it_is_mounted_waits_for_its_rows():
    """The app pushes the dialog, and the next pull may come before Textual composed it: update() raised
    NoMatches there (once in a run of screenshots/take.py); its rows are drawn at compose."""
    from gputui.tui.view import RunView

    OomScreen(RunView(), {}).update()


@pytest.mark.parametrize("key", ["l", "m", "w", "q", "oom"])
async def test_the_script_ending_while_the_app_shuts_down_draws_nothing(make_app, hub, key):
    """Under run_test (the tests, screenshots/take.py) Textual's shutdown takes the screens apart while the
    app still handles its messages: the script ending then asked the screen on top to update, and the log,
    memory, planner and quit screens' query_one raised NoMatches (is_mounted stays true), as the OOM
    dialog's did. A closing app draws nothing."""
    oom = key == "oom"
    app = make_app(batch=64, extra="auto_recover=False, memory_budget='40KiB'") if oom else make_app()
    async with app.run_test(size=(100, 30)) as pilot:
        if oom:
            await until(pilot, lambda: isinstance(app.screen, OomScreen))
        else:
            await started(pilot, app, hub)
            await pilot.press(key)
            await pilot.pause(0.2)
        app._running = False  # what App._shutdown does first, then it removes each screen's widgets
        await app.screen.remove_children()
        app.on_script_ended(ScriptEnded(1, "gputui: boom"))


async def test_top_tensors_screen_lists_the_parameters(make_app, hub):
    app = make_app()
    async with app.run_test(size=(100, 30)) as pilot:
        await started(pilot, app, hub)
        await pilot.press("t")
        assert isinstance(app.screen, TopTensorsScreen)
        await until(pilot, lambda: app.view.top is not None)
        table = app.screen.query_one("#top-table")
        await until(pilot, lambda: table.row_count)  # filled at the next refresh
        roles = {str(table.get_row_at(i)[5]) for i in range(table.row_count)}
        top = app.view.top
        assert "parameter" in roles and table.row_count > 3, {
            k: top.get(k) for k in ("complete", "scanned", "elapsed_s", "groups", "rows")
        }
        timeline = text(app, "#timeline")  # every request is answered there, this one too
        assert "requested: top tensors" in timeline and "✓ top tensors:" in timeline, timeline


async def test_own_loop_script_is_observed(own_loop_app, hub):
    app = own_loop_app(OWN_LOOP)
    said = []
    notify = app.notify
    app.notify = lambda message, **kw: (said.append(message), notify(message, **kw))
    async with app.run_test(size=(110, 32)) as pilot:
        await until(pilot, lambda: app.view.latest is not None and app.view.latest.step >= 3)
        assert "own loop, observed" in text(app, "#remedies")
        assert "from backward()" in text(app, "#loss")
        await pilot.press("b")
        assert said[-1] == "the script runs its own loop: this needs gputui.fit (README: Adopting fit)"
        await pilot.press("f")
        await until(pilot, lambda: any(e.name == "cache_freed" for e in hub.events()))
        await until(pilot, lambda: "loss: " in text(app, "#log"))
        recorded = hub.latest()
        assert recorded.loss_source == "backward()" and recorded.batch_size == 0
