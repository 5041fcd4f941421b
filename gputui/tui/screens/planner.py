"""The what-if planner's table: each remedy's predicted peak, against the capacity, with the calibration."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.widgets import DataTable, Footer, Static

from ...telemetry.describe import number
from ...telemetry.sample import Event
from ...units import format_bytes, format_pieces
from ..availability import cannot_send
from ..keys import for_remedy
from ..messages import RequestControl
from ..planned import fresh, option, options, pieces
from ..view import RunView
from .base import Overlay

TRIGGERS = {
    "asked": "asked for",
    "oom": "after an OOM",
    "near_capacity": "the step peak came near the capacity",
    "calibrated": "again, with the correction the run measured",
    "changed": "the settings changed",
}


PLAN_REQUEST = "plan"
"""How the timeline names the planner's request, and how the screen finds it among those pending."""


class PlannerScreen(Overlay):
    """The what-if table: every remedy's predicted step peak against the capacity, from the latest
    plan the run sent. It asks for one when it opens (and on r) where the run can take the control;
    a plan made for other settings than the run's now is stale: dimmed, and said so."""

    BINDINGS = [*Overlay.BINDINGS, Binding("w", "dismiss", "back", show=False), Binding("r", "ask", "plan again")]

    def __init__(self, view: RunView, watch_only: str | None) -> None:
        super().__init__()
        self.view, self.watch_only = view, watch_only
        self._shown: tuple[Event | None, bool, bool, bool] | None = None

    def compose(self) -> ComposeResult:
        yield Static(id="plan-status")
        yield Static(id="plan-calibration")
        table: DataTable[str | Text] = DataTable(id="plan-table", zebra_stripes=True, cursor_type="row")
        table.add_columns("key", "remedy", "micro-batch", "AMP", "ckpt", "peak", "of capacity", "phase", "prediction")
        yield table
        yield Static(id="plan-detail")
        yield Footer()

    def on_mount(self) -> None:
        self.ask(quiet=True)  # the first update is the Overlay's (its on_mount runs too)

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """r is not offered to a watch-only screen, which can never ask."""
        return not (action == "ask" and self.watch_only)

    def action_ask(self) -> None:
        self.ask(quiet=False)

    def ask(self, *, quiet: bool) -> None:
        """Send the plan control, or say why not (on opening the screen says it in its status line)."""
        reason = cannot_send(self.view, "plan", self.watch_only)
        if reason:
            if not quiet:
                self.notify(reason, title="plan", severity="warning", timeout=4)
            return
        self.post_message(RequestControl("plan", text=PLAN_REQUEST))

    @property
    def planning(self) -> bool:
        """A plan asked for and not answered yet, or the latest one still coming in."""
        plan = self.view.plan
        return PLAN_REQUEST in self.view.pending.values() or (plan is not None and not plan.get("complete", True))

    def update(self) -> None:
        key = (self.view.plan, fresh(self.view), self.planning, self.view.training)
        if self.is_mounted and key != self._shown:
            self._shown = key
            self._fill()

    def _fill(self) -> None:
        v, plan = self.view, self.view.plan
        self.query_one("#plan-status", Static).update(plan_status(v, self.planning, self.watch_only))
        self.query_one("#plan-calibration", Static).update(calibration(v) if plan is not None else "")
        table: DataTable[str | Text] = self.query_one("#plan-table", DataTable)
        row = table.cursor_row
        table.clear()
        capacity = number(plan.get("capacity")) if plan is not None else None
        stale = not fresh(v)
        for choice in options(v):
            table.add_row(*plan_cells(choice, capacity, stale=stale))
        if table.row_count:
            table.move_cursor(row=min(row, table.row_count - 1))
        self._detail(table.cursor_row)

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        self._detail(event.cursor_row)

    def _detail(self, row: int) -> None:
        rows = options(self.view)
        text = breakdown(rows[row]) if 0 <= row < len(rows) else Text("")
        self.query_one("#plan-detail", Static).update(text)


def plan_status(v: RunView, planning: bool, watch_only: str | None) -> Text:
    """What the table is: when and why it was made, against what capacity, whether it is still the
    run's (stale, still coming in), and whether this screen can ask for another."""
    plan, cannot = v.plan, cannot_send(v, "plan", watch_only)
    text = Text()
    if plan is None:
        if planning:
            text.append("planning… ", style="bold yellow").append(
                "each remedy's step is traced at the next step boundaries (without allocating its memory)", style="dim"
            )
        else:
            text.append("No plan from the run yet.", style="bold")
    else:
        capacity, trigger = number(plan.get("capacity")), str(plan.get("trigger", "?"))
        text.append(f"Plan at step {plan.step}", style="bold")
        text.append(f" ({TRIGGERS.get(trigger, trigger)})")
        if capacity:
            budget = "CPU memory budget (gputui's tracker counts)" if plan.get("tracked") else "capacity"
            text.append(f" · {budget} {format_bytes(capacity)}")
        else:
            text.append(" · capacity unknown: no fit marks")
        if not plan.get("complete", True):
            text.append(" · planning… more rows come at the next step boundaries", style="bold yellow")
        elif planning:
            text.append(" · planning again… the table follows when the run answers", style="bold yellow")
        if not fresh(v) and v.pieces is not None:
            checkpointing = "on" if v.checkpointing else "off"
            now = f"micro-batch {format_pieces(*v.pieces, spaced=True)}, AMP {v.amp}, checkpointing {checkpointing}"
            text.append(
                f"\nstale: made for other settings than the run's now ({now})" + ("" if cannot else "; r plans again"),
                style="bold yellow",
            )
    if cannot:
        what = "shows the run's latest plan but cannot ask for one" if plan is not None else "cannot ask for one"
        text.append(f"\nThis screen {what}: {cannot}", style="dim italic")
    elif plan is not None and fresh(v):
        text.append(
            "\n✓ fits with the planner's margin, ✗ does not; ~ an estimate, not traced. r plans again.", style="dim"
        )
    return text


def calibration(v: RunView) -> Text:
    """The prediction for the setting in use against the peak the run then measured: the correction
    every traced prediction carries."""
    plan = v.plan
    assert plan is not None
    now, measured, correction = option(v, "now"), number(plan.get("measured")), number(plan.get("correction")) or 0
    sign = "+" if correction >= 0 else ""
    text = Text().append("Calibration: ", style="bold")
    if measured is None or now is None:
        text.append(f"no step measured at these settings yet; correction {sign}{format_bytes(correction)}")
        return text
    predicted = format_bytes(number(now.get("predicted")), missing="?")
    text.append(f"measured {format_bytes(measured)} vs predicted {predicted} as now")
    ckpt = ", checkpointing" if now.get("checkpointing") else ""
    text.append(f" (micro-batch {pieces(now)}, AMP {now.get('amp', '?')}{ckpt})")
    text.append(f": {sign}{format_bytes(correction)} added to each traced prediction")
    text.append(" (allocator rounding, workspaces a trace cannot see)", style="dim")
    return text


def plan_cells(o: Mapping[str, Any], capacity: float | None, *, stale: bool) -> list[Text]:
    """A row of the planner's table; a stale plan's rows dimmed."""

    def cell(value: str, style: str = "", right: bool = False) -> Text:
        return Text(value, style="dim" if stale else style, justify="right" if right else "left")

    label, peak, fits, exact = str(o.get("label", "?")), number(o.get("peak")), o.get("fits"), o.get("exact")
    remedy = {"now": "as now", "best": f"best fit: {label}"}.get(str(o.get("remedy")), label)
    share = cell(f"{peak / capacity:.0%}" if capacity and peak is not None else "–", right=True)
    if isinstance(fits, bool):
        share.append(" ✓" if fits else " ✗", style="" if stale else "bold green" if fits else "bold red")
    how = "exact" if exact else "approx"
    if o.get("reason"):
        how += f": {o['reason']}"
    return [
        cell(for_remedy(o.get("remedy")), "bold"),
        cell(remedy),
        cell(pieces(o)),
        cell(str(o.get("amp", "?"))),
        cell("on" if o.get("checkpointing") else "off"),
        cell(("" if exact else "~") + format_bytes(peak, missing="?"), right=True),
        share,
        cell(str(o.get("phase", "?"))),
        cell(how, "" if exact else "yellow"),
    ]


def breakdown(o: Mapping[str, Any]) -> Text:
    """Where the highlighted option's peak goes, and what it cost to predict."""
    sizes, seconds = o.get("breakdown"), number(o.get("seconds"))
    parts = (
        [f"{name} {format_bytes(number(size), missing='?')}" for name, size in sizes.items()]
        if isinstance(sizes, Mapping)
        else []
    )
    text = Text().append(f"{o.get('label', '?')}: ", style="bold")
    text.append(" · ".join(parts) or "no breakdown")
    text.append(f" · before correction {format_bytes(number(o.get('predicted')), missing='?')}", style="dim")
    text.append(f" · predicted in {'?' if seconds is None else f'{seconds:.2f}'} s", style="dim")
    return text
