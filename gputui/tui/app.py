"""The Textual app: the main screen over a Source, keys that send controls, the script in a thread.

The UI thread is the only one that touches widgets: a timer pulls from the source a few times a
second (`--refresh`), folds it into the RunView and has the panels whose data changed re-render,
inside one batch_update. State goes down (each panel and screen is given the view or the output
it shows), requests come up (screens post messages.py's messages). The training thread never
waits on the UI: it publishes into the hub and drains controls at its step boundaries.
"""

from __future__ import annotations

import io
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from textual import events
from textual.app import App, ComposeResult, SystemCommand
from textual.binding import Binding
from textual.containers import Horizontal
from textual.message import Message
from textual.screen import Screen

from ..telemetry.output import OutputLog
from ..telemetry.sample import Event
from .availability import cannot_send, halved, micro_batch_once_applied, why_not
from .keys import BY_KEY, KEYS, Key, shown
from .messages import RequestControl, ShowScreen
from .palette import Actions
from .panels.base import Panel
from .panels.footer import KeysFooter
from .panels.gpus import GpuLine
from .panels.header import HeaderBar
from .panels.log import LogPanel
from .panels.loss import LossPanel
from .panels.memory import MemoryPanel
from .panels.ranks import RanksPanel
from .panels.remedies import RemediesBar
from .panels.timeline import Timeline
from .screens import (
    ConfirmQuit,
    FailureScreen,
    HelpScreen,
    LogScreen,
    MemoryScreen,
    OomScreen,
    Overlay,
    PlannerScreen,
    TopTensorsScreen,
)
from .screens.dialogs import stop_effect
from .sources import Source
from .view import RunView

Runner = Callable[[io.StringIO], int]
"""Runs the training script (writing any failure report to the stream); returns its exit code."""


class ScriptEnded(Message):
    def __init__(self, code: int, report: str) -> None:
        super().__init__()
        self.code, self.report = code, report


class MainScreen(Screen[None]):
    """The panels, and the keys: bound here so screens above it do not list them in their footers."""

    BINDINGS = [
        Binding(k.key, f"app.{k.action}", k.label, key_display=shown(k) if shown(k) != k.key else None) for k in KEYS
    ]

    def __init__(self, view: RunView, source: Source, output: OutputLog) -> None:
        super().__init__()
        self.view, self.source, self.output = view, source, output
        v = view
        self.log_panel, self.gpu_line, self.ranks = (
            LogPanel(output, id="log"),
            GpuLine(v, id="gpus"),
            RanksPanel(v, id="ranks"),
        )
        self._top = (HeaderBar(v, source.watch_only, id="header"), MemoryPanel(v, id="memory"), LossPanel(v, id="loss"))
        self._middle = (RemediesBar(v, source.watch_only, id="remedies"), Timeline(v, id="timeline"))
        # Kept, not queried: a pull a few times a second walks no DOM.
        self.panels: list[Panel] = [*self._top, self.ranks, *self._middle, self.log_panel, self.gpu_line]

    def compose(self) -> ComposeResult:
        header, memory, loss = self._top
        remedies, timeline = self._middle
        yield header
        with Horizontal(id="panels"):
            yield memory
            yield loss
        yield self.ranks
        yield remedies
        with Horizontal(id="bottom"):
            yield timeline
            yield self.log_panel
        yield self.gpu_line
        yield KeysFooter()

    def on_mount(self) -> None:
        self.query_one("#timeline").border_title = "events"
        self.query_one("#log").border_title = "script output"
        self.update()  # what the app pulled before the panels were up: laid out from the first frame

    def update(self) -> None:
        """After a pull: the panels the run needs, each redrawn if what it shows changed."""
        if not self.log_panel.is_attached:  # not composed yet, or the app is closing
            return
        self.log_panel.display = self.view.observed
        self.gpu_line.display = self.view.gpus is not None
        self.ranks.display = bool(self.view.job_ranks)  # a torchrun job's: one process has no ranks to show
        for panel in self.panels:
            panel.redraw()

    def on_resize(self, event: events.Resize) -> None:
        self.set_class(event.size.height < 30, "-short")
        self.set_class(event.size.height >= 45, "-tall")
        self.ranks.redraw()  # how many ranks it has lines for follows the height

    def on_key(self, event: events.Key) -> None:
        """A dimmed key does nothing, but says why."""
        key = BY_KEY.get(event.key)
        reason = why_not(self.view, key.action, self.source.watch_only) if key is not None else None
        if key is not None and reason:
            self.notify(reason, title=key.label, severity="warning", timeout=4)


class GputuiApp(App[int]):
    CSS_PATH = "app.tcss"
    TITLE = "gputui"
    COMMANDS = App.COMMANDS | {Actions}
    BINDINGS = [Binding("ctrl+c", "interrupt", "stop", show=False, priority=True)]

    def __init__(
        self,
        source: Source,
        *,
        script: str,
        runner: Runner | None = None,
        refresh: float = 4.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        self.source = source
        self.view = RunView(clock=clock, script=script)
        self.runner = runner
        self.refresh_hz = refresh
        self.output = OutputLog()  # the script's output as the source brings it
        self.script_code: int | None = None  # the script's exit code, once it has ended
        self._thread: threading.Thread | None = None
        self._quitting = False
        self._warned_paused = False
        self._oom_shown: Event | None = None
        self._availability: tuple[str | None, ...] = ()
        self.main = MainScreen(self.view, source, self.output)

    def on_mount(self) -> None:
        self.push_screen(self.main)
        self.begin_capture_print(self)
        if self.runner is not None:
            # Our own daemon thread, not a Textual worker: executor threads are joined at exit,
            # so a script still running would hang a forced quit.
            self._thread = threading.Thread(target=self._run_script, name="gputui-training", daemon=True)
            self._thread.start()
        self.set_interval(1 / self.refresh_hz, self.pull)
        self.pull()

    @property
    def attached(self) -> bool:
        """`gputui attach`'s screen: it leaves and the job trains on (the job of `gputui run`'s own screens,
        one process or torchrun's, is theirs to stop)."""
        return self.view.remote and self.runner is None

    @property
    def training_thread(self) -> threading.Thread | None:
        return self._thread

    def _run_script(self) -> None:
        report = io.StringIO()
        try:
            code = self.runner(report)  # type: ignore[misc]
        except BaseException as exc:
            code = 1
            report.write(f"gputui: {type(exc).__name__}: {exc}\n")
        self.script_code = code  # read directly if the app is gone (the terminal hung up)
        self.post_message(ScriptEnded(code, report.getvalue()))

    # -- the pull --------------------------------------------------------------------------------
    def pull(self) -> None:
        if not self.is_running:  # shutting down: the timer may tick while the screens are taken apart
            return
        update = self.source.poll()
        self.output.add(update.output, update.current)
        printed = bool(update.output) or update.current is not None
        if self.view.apply(update) or self.view.training or printed:
            self.show()

    def show(self) -> None:
        """The view changed: the panels redraw what changed, and what follows from it (keys, dialogs).
        Not while the app closes: under run_test Textual takes the screens apart while the app still handles
        messages (the script ending), and a screen's query_one found no widget there (NoMatches)."""
        if not self.is_running:
            return
        with self.batch_update():
            self.main.update()
            if isinstance(self.screen, (Overlay, ConfirmQuit, OomScreen)):
                self.screen.update()
        availability = tuple(self.why_not(k.action) for k in KEYS)
        if availability != self._availability:
            self._availability = availability
            self.refresh_bindings()
        oom = self.view.waiting_oom
        if oom is not None and oom is not self._oom_shown:
            self._oom_shown = oom
            why = {k.control: self.why_not(k.action) for k in KEYS if k.control}
            why["plan"] = cannot_send(self.view, "plan", self.source.watch_only)  # the w its hint names
            self.push_screen(OomScreen(self.view, why), self._oom_choice)
        if self.view.signalled and not self._quitting:
            self.leave_when_done(self.view.signalled)

    def on_script_ended(self, message: ScriptEnded) -> None:
        self.pull()  # the last samples first: a short run can end between two pulls
        failure = message.report or (f"exit code {message.code}" if message.code else None)
        self.view.script_ended(message.code, failure if message.code else None)
        self.show()  # changed outside a pull: a script that never started a run leaves "starting" too
        if self._quitting:
            self.exit(message.code)
        elif message.code:
            self.push_screen(FailureScreen(self.view))

    def on_print(self, event: events.Print) -> None:
        self.output.write(event.text)

    # -- keys ------------------------------------------------------------------------------------
    def why_not(self, action: str) -> str | None:
        return why_not(self.view, action, self.source.watch_only)

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        return None if self.why_not(action) else True

    def get_system_commands(self, screen: Screen[Any]) -> Iterable[SystemCommand]:
        """Textual's, less its Quit ("as soon as possible": ours asks first, and the palette lists it)."""
        return (command for command in super().get_system_commands(screen) if command.title != "Quit")

    def palette(self) -> list[tuple[Key, str, str]]:
        """Every key as the command palette lists it: (key, name, help or why it cannot act now)."""
        rows = []
        for k in KEYS:
            reason = self.why_not(k.action)
            rows.append((k, f"{k.label} ({shown(k)})", f"unavailable: {reason}" if reason else k.help))
        return rows

    async def act(self, action: str) -> None:
        """Run an action by name, or say why it cannot run now: the palette's and the screens' way in.
        A coroutine (run_action is one): the palette's command and the message handler await it."""
        reason = self.why_not(action)
        if reason:
            self.notify(reason, severity="warning", timeout=4)
        else:
            await self.run_action(action)

    def send(self, action: str, value: Any = None, text: str | None = None) -> None:
        try:
            request = self.source.request(action, value)
        except RuntimeError as exc:  # the job refused or cannot be reached
            self.notify(str(exc), severity="error", timeout=6)
            return
        self.view.requested(request, text or action.replace("_", " "), action, value)
        self.pull()

    def on_request_control(self, message: RequestControl) -> None:
        self.send(message.action, message.value, message.text)

    async def on_show_screen(self, message: ShowScreen) -> None:
        await self.act(message.name)

    def action_halve_batch(self) -> None:
        micro = micro_batch_once_applied(self.view)
        sizes = f" ({micro} -> {halved(self.view, micro)})" if micro else ""
        self.send("halve_batch", text=f"halve micro-batch{sizes}")

    def action_double_batch(self) -> None:
        self.send("double_batch", text="double micro-batch")

    def action_cycle_amp(self) -> None:
        mode = self.view.next_amp()
        self.send("set_amp", mode, text=f"AMP {mode}")

    def action_toggle_checkpointing(self) -> None:
        on = not self.view.pending.once_applied(("set_checkpointing",), self.view.checkpointing)
        self.send("set_checkpointing", on, text=f"checkpointing {'on' if on else 'off'}")

    def action_free_cache(self) -> None:
        self.send("free_cache", text="free cache")

    def action_toggle_auto_recover(self) -> None:
        on = not self.view.pending.once_applied(("set_auto_recover",), self.view.auto_recover)
        self.send("set_auto_recover", on, text=f"auto-recover {'on' if on else 'off'}")

    def action_toggle_pause(self) -> None:
        now = "pause" if self.view.paused else "resume"
        self.send("resume" if self.view.pending.once_applied(("pause", "resume"), now) == "pause" else "pause")

    def action_snapshot(self) -> None:
        self.send("snapshot", text="memory snapshot")

    def action_top_tensors(self) -> None:
        self.send("top_tensors", text="top tensors")
        self.push_screen(TopTensorsScreen(self.view))

    def action_plan(self) -> None:
        self.push_screen(PlannerScreen(self.view, self.source.watch_only))  # it asks for a plan where it can

    def action_memory(self) -> None:
        if not cannot_send(self.view, "memory_summary", self.source.watch_only):
            self.send("memory_summary", text="memory summary")
        self.push_screen(MemoryScreen(self.view))

    def action_log(self) -> None:
        self.push_screen(LogScreen(self.output))

    def action_help(self) -> None:
        self.push_screen(HelpScreen(attached=self.attached))

    def _oom_choice(self, choice: str | None) -> None:
        if not choice:
            return
        values = {"set_amp": "bf16", "set_checkpointing": True}
        self.send(choice, values.get(choice), text=f"after the OOM: {choice.replace('_', ' ')}")

    # -- leaving ---------------------------------------------------------------------------------
    def action_quit(self) -> None:  # type: ignore[override]
        if self.attached and self.view.paused and self.view.training and not self.source.watch_only:
            if not self._warned_paused:  # an attached screen leaves; the job it paused would wait for no one
                self._warned_paused = True
                self.notify("the job stays paused after you leave: p resumes it; q again leaves", severity="warning")
                return
        if self._quitting or not self._script_running():
            self._leave()
        else:
            self.push_screen(ConfirmQuit(self.view), lambda yes: self._stop_then_quit() if yes else None)

    def action_interrupt(self) -> None:
        """Ctrl-C: stop after the current step and quit; a second one quits at once."""
        if self._quitting or not self._script_running():
            self._leave()
        else:
            self._stop_then_quit()

    def _script_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def leave_when_done(self, reason: str) -> None:
        """The run was signalled (`reason`): its fit stops after the step and the script finishes (its save
        runs; an own loop gets a KeyboardInterrupt), then the app leaves with the script's code."""
        if not self._script_running():
            self.exit(self.script_code if self.script_code is not None else 1)
            return
        self._quitting = True
        self.view.stopping = True
        self.notify(
            f"{reason}: stopping after the current step ({stop_effect(self.view)[1]}); gputui exits when "
            "the script ends. Again to stop at once.",
            timeout=30,
        )

    def _stop_then_quit(self) -> None:
        self._quitting = True
        self.view.stopping = True
        # Sent even before the first step is seen (the script may still be importing torch): the
        # run stops at its first boundary instead of training on after the user quit.
        self.send("stop", text="stop")
        self.notify(
            f"Stopping after the current step ({stop_effect(self.view)[1]}). q again quits at once.",
            timeout=10,
        )

    def _leave(self) -> None:
        code = self.view.exit_code
        self.exit(code if code is not None else (130 if self._script_running() else 0))
