"""The OOM dialog (auto-recover off): what failed, the memory then, each remedy's predicted peak, and
the keys that retry the batch with one."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Label, Static

from ...telemetry.describe import number
from ...units import format_bytes
from ..planned import option, options, pieces
from ..view import RunView
from .planner import PLAN_REQUEST


class OomScreen(ModalScreen[str | None]):
    """Auto-recover is off and a step ran out of memory: the user picks the remedy, beside the step peak
    the planner predicts for each (the run plans at the OOM by itself, or when asked: escape, then w)."""

    BINDINGS = [
        Binding("b", "pick('halve_batch')", "halve"),
        Binding("a", "pick('set_amp')", "AMP bf16"),
        Binding("c", "pick('set_checkpointing')", "ckpt"),
        Binding("f", "pick('free_cache')", "free"),
        Binding("r", "pick('resume')", "retry"),
        Binding("x", "pick('stop')", "stop"),
        Binding("escape", "pick('')", "later"),
        Binding("q", "app.quit", "quit", show=False),  # as on the main screen: asks, then stops
    ]

    def __init__(self, view: RunView, why_not: dict[str, str | None]) -> None:
        super().__init__()
        self.view = view
        self.why_not = why_not  # control action -> why it cannot act now (None: it can)

    def compose(self) -> ComposeResult:
        e = self.view.waiting_oom
        m = self.view.latest.memory if self.view.latest else None
        details = Text()
        if e is not None:
            details.append(
                f"Out of memory in {e['phase']} of step {e.step + 1} at micro-batch {e['micro_batch']}.\n",
                style="bold red",
            )
            details.append(f"{e['message']}\n", style="dim")
        if m is not None:
            figures = [
                f"{name} {format_bytes(value)}"
                for name, value in (
                    ("allocated", m.allocated),
                    ("reserved", m.reserved),
                    ("fragmented", m.fragmented),
                    ("step peak", m.peak),
                    ("capacity", m.capacity),
                )
                if value is not None
            ]
            details.append(f"Memory after the last good step: {', '.join(figures)}.\n")
        details.append(
            "Training waits here: pick a remedy and the same batch is retried with it "
            "(escape decides later; the keys on the main screen still work).",
            style="dim",
        )
        with Vertical(id="oom-dialog"):
            yield Label("Training paused: out of memory (auto-recover is off)", id="oom-title")
            yield Static(details, id="oom-details")
            yield Static(oom_predictions(self.view, self.why_not.get("plan")), id="oom-plan")
            with Horizontal(id="oom-buttons"):
                for action, label in (
                    ("halve_batch", "[b] halve batch"),
                    ("set_amp", "[a] AMP bf16"),
                    ("set_checkpointing", "[c] checkpointing"),
                    ("free_cache", "[f] free cache"),
                    ("resume", "[r] retry as is"),
                    ("stop", "[x] stop"),
                ):
                    yield Button(
                        Text(label),
                        id=action,
                        variant="error" if action == "stop" else "primary",
                        disabled=bool(self.why_not.get(action)),
                        tooltip=self.why_not.get(action),
                    )

    def update(self) -> None:
        """Called by the app after each pull while this dialog is on top: the planner's rows as they come.
        Before compose and while the dialog is taken apart (the script ended under it) there are no rows to
        fill: a query_one there raised NoMatches and took the app down."""
        for plan in self.query("#oom-plan").results(Static):
            plan.update(oom_predictions(self.view, self.why_not.get("plan")))

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id)

    def action_pick(self, action: str) -> None:
        reason = self.why_not.get(action) if action else None
        if reason:
            self.notify(reason, severity="warning")
            return
        self.dismiss(action or None)


def oom_predictions(v: RunView, cannot_plan: str | None) -> Text:
    """The dialog's remedies with the step peak the planner predicts for each, from a table made at this
    OOM (for the setting that failed); "planning…" while it is made; else how to ask for one."""
    oom, plan = v.waiting_oom, v.plan
    now = option(v, "now")
    text = Text()
    if oom is None:
        return text
    made = (
        plan is not None and plan.step >= oom.step and (now is None or now.get("micro_batch") == oom.get("micro_batch"))
    )
    if plan is None or not made or (now is None and not plan.get("complete", True)):
        if oom.get("planning") or PLAN_REQUEST in v.pending.values():
            text.append("planning… ", style="bold yellow")
            text.append("each remedy's step is traced on fake tensors (nothing allocated)", style="dim")
        elif not cannot_plan:
            text.append("Escape, then w: the step peak the planner predicts for each remedy.", style="dim")
        return text
    if now is None:
        return text.append("The planner has no prediction for this step.", style="dim")
    capacity = number(plan.get("capacity"))
    text.append(f"Predicted step peaks{f' (capacity {format_bytes(capacity)})' if capacity else ''}:", style="bold")
    amp = next((o for o in options(v) if o.get("remedy") == "amp" and o.get("amp") == "bf16"), None)
    checkpointing = option(v, "checkpointing")
    best = option(v, "best")
    rows = [
        ("[b]", option(v, "halve")),
        ("[a] bf16", amp),
        ("[c] ckpt", checkpointing if checkpointing and checkpointing.get("checkpointing") else None),
        ("[r] as is", now),
        (f"best fit {best.get('label', '?')}" if best else "", best),
    ]
    for label, o in [(label, o) for label, o in rows if o is not None]:
        text.append(" " if text.plain.endswith(":") else " · ").append(label, style="bold")
        if o.get("remedy") == "halve":
            text.append(f" {pieces(o)}")
        text.append(f" {'' if o.get('exact') else '~'}{format_bytes(number(o.get('peak')), missing='?')}")
        if isinstance(o.get("fits"), bool):
            text.append(" ✓" if o["fits"] else " ✗", style="bold green" if o["fits"] else "bold red")
    return text
