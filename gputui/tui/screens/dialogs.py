"""The quit confirmation (its words depend on what stopping does to this script) and the failure report."""

from __future__ import annotations

from rich.console import Group
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Footer, Label, Static

from ..messages import ShowScreen
from ..view import RunView
from .base import Overlay


class ConfirmQuit(ModalScreen[bool]):
    """Stop and quit? With what stopping does to this script (stop_effect(), below), kept up to date:
    asked before the run started, it says so, and changes once the run says how it trains."""

    BINDINGS = [
        Binding("y", "answer(True)", "yes"),
        Binding("n,escape", "answer(False)", "no"),
        Binding("q", "answer(True)", "yes", show=False),
    ]

    def __init__(self, view: RunView) -> None:
        super().__init__()
        self.view = view

    def _text(self) -> str:
        question, effect = stop_effect(self.view)
        return f"{question}\n({effect})"

    def compose(self) -> ComposeResult:
        with Vertical(id="confirm"):
            yield Label(self._text(), id="confirm-text")
            with Horizontal(id="confirm-buttons"):
                yield Button(Text("[y] stop and quit"), id="yes", variant="error")
                yield Button(self._keep(), id="no", variant="primary")

    def _keep(self) -> Text:
        return Text("[n] keep it paused" if self.view.paused else "[n] keep training")

    def update(self) -> None:
        """Called by the app after each pull while this screen is on top."""
        if self.is_mounted:
            self.query_one("#confirm-text", Label).update(self._text())
            self.query_one("#no", Button).label = self._keep()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes)


class FailureScreen(Overlay):
    """The script failed: its traceback and what to do, over the figures it reached."""

    BINDINGS = [
        Binding("escape", "dismiss", "figures"),
        Binding("l", "show('log')", "output"),
        Binding("q", "app.quit", "quit"),
    ]  # as its text says (the main screen's keys are not bound here)

    def __init__(self, view: RunView) -> None:
        super().__init__()
        self.view = view

    def action_show(self, name: str) -> None:
        self.post_message(ShowScreen(name))

    def compose(self) -> ComposeResult:
        v = self.view
        head = Text(f"{v.script} failed (exit code {v.exit_code}).", style="bold red")
        advice = Text(
            "The figures it reached stay on the main screen (escape). Fix the script and run it again; "
            "l shows its output, q quits with its exit code.",
            style="dim",
        )
        yield VerticalScroll(Static(Group(head, Text(""), Text(v.failure or ""), advice), id="failure-text"))
        yield Footer()


def stop_effect(v: RunView) -> tuple[str, str]:
    """What a quit asks, and what stopping does to this script: a fit() returns and the code after it
    runs, an own loop gets a KeyboardInterrupt (observe.py). The quit dialog shows both, the notices
    the second."""
    if v.info is None:  # the script is still importing or loading: either may come
        return (
            "Training has not started yet. Stop it and quit?",
            "a fit() stops at its first step and the code after it runs; a loop of the script's own "
            "gets a KeyboardInterrupt",
        )
    if v.info.observed:
        return (
            "The script's own loop is training. Stop it and quit?",
            "the script gets a KeyboardInterrupt after its next optimizer step: the code after its loop, "
            "a save there, does not run unless it catches it",
        )
    if v.paused:
        return (
            "Training is paused. Stop it and quit?",
            "the script goes on from the paused step, where fit() returns or a Trainer loop sees result.stopped: "
            "your save happens",
        )
    return (
        "Training is running. Stop after the current step and quit?",
        "the script goes on after this step, where fit() returns or a Trainer loop sees result.stopped: "
        "your save happens",
    )
