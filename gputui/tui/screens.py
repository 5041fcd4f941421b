"""Screens over the main one: help, OOM dialog, top tensors, the what-if planner, memory readings,
the script's log, quit confirmation, and the failure report.

Each is given what it shows (the RunView, the script's output) and asks the app for anything else
with a message (messages.py): none knows the app.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen, Screen
from textual.widgets import Button, DataTable, Footer, Label, RichLog, Static

from ..telemetry.describe import number
from ..telemetry.output import OutputLog
from ..telemetry.sample import Event
from ..units import format_bytes, format_figure
from .keys import KEYS, for_remedy, shown
from .messages import RequestControl, ShowScreen
from .view import RunView


class Overlay(Screen[None]):
    """A full screen the user leaves with escape (or its own key again)."""

    BINDINGS = [Binding("escape", "dismiss", "back"), Binding("q", "dismiss", "back", show=False)]

    def action_dismiss(self) -> None:  # type: ignore[override]
        self.dismiss()

    def update(self) -> None:
        """Called by the app after each pull while this screen is on top."""


class HelpScreen(Overlay):
    BINDINGS = [*Overlay.BINDINGS, Binding("question_mark", "dismiss", "back", show=False)]

    def compose(self) -> ComposeResult:
        keys = Table.grid(padding=(0, 2))
        keys.add_column(style="bold", no_wrap=True)
        keys.add_column()
        for k in KEYS:
            keys.add_row(shown(k), k.help)
        keys.add_row("ctrl+c", "Stop after the current step, then quit (twice: quit now).")
        keys.add_row("ctrl+p", "Command palette: every action above, searchable.")
        panels = Text.from_markup(
            "[b]Memory[/b]: the bar is the device's capacity (CUDA: total or --gpu-memory-limit; CPU: the "
            "budget, else the machine's memory). [blue]allocated[/] = live tensors; "
            "[cyan]reserved[/] = held by PyTorch's caching allocator (allocated + cached free); "
            "[yellow]fragmented[/] = freed pieces of segments still in "
            "use, which empty_cache cannot return; [magenta]other[/] = what NVML sees beyond reserved: the CUDA "
            "context, cuBLAS/cuDNN/NCCL workspaces, other processes. ┃ marks this step's peak; a red ┃ and a "
            "warning mean the peak is within 10% of the capacity. retries = the allocator freed its cache to "
            "satisfy an allocation (slow, the road to an OOM).\n\n"
            "[b]Remedies[/b] apply at the next step boundary, never inside an accumulation window; the timeline "
            "shows each request and when it was applied.\n\n"
            "[b]OOM[/b]: with auto-recover on, the step is replayed with half the micro-batch (same batch, same "
            "RNG, counters untouched); off, a dialog asks what to do."
        )
        yield VerticalScroll(
            Static(
                Group(
                    Text("Keys", style="bold underline"),
                    keys,
                    Text(""),
                    Text("What the panels mean", style="bold underline"),
                    panels,
                ),
                id="help-text",
            )
        )
        yield Footer()


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
        """Called by the app after each pull while this dialog is on top: the planner's rows as they come."""
        self.query_one("#oom-plan", Static).update(oom_predictions(self.view, self.why_not.get("plan")))

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
    now = v.plan_option("now")
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
    text.append(f"Predicted step peak{f' of {format_bytes(capacity)}' if capacity else ''}:", style="bold")
    amp = next((o for o in v.plan_options if o.get("remedy") == "amp" and o.get("amp") == "bf16"), None)
    checkpointing = v.plan_option("checkpointing")
    best = v.plan_option("best")
    rows = [
        ("[b]", v.plan_option("halve")),
        ("[a] bf16", amp),
        ("[c] ckpt", checkpointing if checkpointing and checkpointing.get("checkpointing") else None),
        ("[r] as is", now),
        (f"best fit {best.get('label', '?')}" if best else "", best),
    ]
    for label, o in [(label, o) for label, o in rows if o is not None]:
        text.append(" " if text.plain.endswith(":") else " · ").append(label, style="bold")
        if o.get("remedy") == "halve":
            text.append(f" {o.get('micro_batch', '?')} × {o.get('accumulation', '?')}")
        text.append(f" {'' if o.get('exact') else '~'}{format_bytes(number(o.get('peak')), missing='?')}")
        if isinstance(o.get("fits"), bool):
            text.append(" ✓" if o["fits"] else " ✗", style="bold green" if o["fits"] else "bold red")
    return text


class TopTensorsScreen(Overlay):
    BINDINGS = [*Overlay.BINDINGS, Binding("t", "dismiss", "back", show=False), Binding("r", "scan", "rescan")]

    def compose(self) -> ComposeResult:
        yield Static("Scanning the live tensors at the next step boundary…", id="top-status")
        table: DataTable[str | Text] = DataTable(id="top-table", zebra_stripes=True, cursor_type="row")
        table.add_columns("bytes", "count", "shape", "dtype", "device", "role", "names")
        yield table
        yield Footer()

    def __init__(self, view: RunView) -> None:
        super().__init__()
        self.view = view
        self._shown: Event | None = None  # the top_tensors event on screen

    def on_mount(self) -> None:
        self.call_after_refresh(self.update)  # is_mounted only turns true after on_mount

    def action_scan(self) -> None:
        self.post_message(RequestControl("top_tensors", text="top tensors"))
        self.query_one("#top-status", Static).update("Scanning again at the next step boundary…")

    def update(self) -> None:
        if self.is_mounted and self.view.top is not self._shown:
            self._shown = self.view.top
            self._fill()

    def _fill(self) -> None:
        e = self._shown
        if e is None:
            return
        table: DataTable[str | Text] = self.query_one("#top-table", DataTable)
        table.clear()
        for r in e["rows"]:
            table.add_row(
                Text(format_bytes(r["bytes"]), justify="right"),
                str(r["count"]),
                "×".join(map(str, r["shape"])) or "scalar",
                r["dtype"],
                r["device"],
                r["role"],
                ", ".join(r.get("names", ())),
            )
        note = "" if e.get("complete", True) else " (scan cut short at its time budget: a partial view)"
        unnamed = (
            " An own loop's tensors go unnamed: gputui sees its optimizer, not its model." if self.view.observed else ""
        )
        self.query_one("#top-status", Static).update(
            f"{format_bytes(e['total_bytes'])} in {e['tensors']} tensors ({e['groups']} groups) at step "
            f"{e.step}, scanned in {e['elapsed_s'] * 1000:.0f} ms{note}. Views share storage: counted once.{unnamed} "
            "r rescans."
        )


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
        self.ask(quiet=True)
        self.call_after_refresh(self.update)  # is_mounted only turns true after on_mount

    def action_ask(self) -> None:
        self.ask(quiet=False)

    def ask(self, *, quiet: bool) -> None:
        """Send the plan control, or say why not (on opening the screen says it in its status line)."""
        reason = self.view.cannot_send("plan", self.watch_only)
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
        key = (self.view.plan, self.view.plan_fresh, self.planning, self.view.training)
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
        for option in v.plan_options:
            table.add_row(*plan_cells(option, capacity, stale=not v.plan_fresh))
        if table.row_count:
            table.move_cursor(row=min(row, table.row_count - 1))
        self._detail(table.cursor_row)

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        self._detail(event.cursor_row)

    def _detail(self, row: int) -> None:
        options = self.view.plan_options
        text = breakdown(options[row]) if 0 <= row < len(options) else Text("")
        self.query_one("#plan-detail", Static).update(text)


def plan_status(v: RunView, planning: bool, watch_only: str | None) -> Text:
    """What the table is: when and why it was made, against what capacity, whether it is still the
    run's (stale, still coming in), and whether this screen can ask for another."""
    plan, cannot = v.plan, v.cannot_send("plan", watch_only)
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
        s = v.latest
        if not v.plan_fresh and s is not None:
            text.append(
                f"\nstale: made for other settings than the run's now (micro-batch {s.micro_batch} × "
                f"{s.accumulation}, AMP {s.amp}, checkpointing {'on' if s.checkpointing else 'off'})"
                + ("" if cannot else "; r plans again"),
                style="bold yellow",
            )
    if cannot:
        what = "shows the run's latest plan but cannot ask for one" if plan is not None else "cannot ask for one"
        text.append(f"\nThis screen {what}: {cannot}", style="dim italic")
    elif plan is not None and v.plan_fresh:
        text.append(
            "\n✓ fits with the planner's margin, ✗ does not; ~ an estimate, not traced. r plans again.", style="dim"
        )
    return text


def calibration(v: RunView) -> Text:
    """The prediction for the setting in use against the peak the run then measured: the correction
    every traced prediction carries."""
    plan = v.plan
    assert plan is not None
    now, measured, correction = v.plan_option("now"), number(plan.get("measured")), number(plan.get("correction")) or 0
    sign = "+" if correction >= 0 else ""
    text = Text().append("Calibration: ", style="bold")
    if measured is None or now is None:
        text.append(f"no step measured at these settings yet; correction {sign}{format_bytes(correction)}")
        return text
    predicted = format_bytes(number(now.get("predicted")), missing="?")
    text.append(f"measured {format_bytes(measured)} vs predicted {predicted} as now")
    ckpt = ", checkpointing" if now.get("checkpointing") else ""
    batch = f"{now.get('micro_batch', '?')} × {now.get('accumulation', '?')}"
    text.append(f" (micro-batch {batch}, AMP {now.get('amp', '?')}{ckpt})")
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
        cell(f"{o.get('micro_batch', '?')} × {o.get('accumulation', '?')}"),
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


class MemoryScreen(Overlay):
    BINDINGS = [*Overlay.BINDINGS, Binding("m", "dismiss", "back", show=False)]

    def __init__(self, view: RunView) -> None:
        super().__init__()
        self.view = view
        self._shown: tuple[int, int, int, str | None] | None = None  # what the report on screen was made of

    def compose(self) -> ComposeResult:
        yield VerticalScroll(Static(id="memory-text"))
        yield Footer()

    def on_mount(self) -> None:
        self.call_after_refresh(self.update)  # is_mounted only turns true after on_mount

    def update(self) -> None:
        v = self.view
        key = (v.generation, v.samples_seen, v.ooms, v.cuda_summary)
        if self.is_mounted and key != self._shown:
            self._shown = key
            self.query_one("#memory-text", Static).update(memory_report(v))


def memory_report(v: RunView) -> Group:
    """Every reading of the latest step with what it means, then torch's own summary (CUDA)."""
    s = v.latest
    if s is None:
        return Group(Text("No step yet.", style="dim"))
    m = s.memory
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold", no_wrap=True)
    table.add_column(justify="right", no_wrap=True)
    table.add_column(style="dim")
    rows = [
        (
            "allocated",
            m.allocated,
            "live tensors"
            if m.reserved is not None
            else "tracked training state: parameters + gradients + optimizer state + saved activations",
        ),
        ("reserved", m.reserved, "segments PyTorch's caching allocator holds (allocated + cached free)"),
        ("cached free", m.cached_free, "reserved but holding no tensor: reused before asking the device"),
        ("fragmented", m.fragmented, "inactive split blocks: free pieces of segments still partly in use"),
        ("active", m.active, "allocated + blocks freed but not yet reusable (pending stream work)"),
        ("step peak", m.peak, "the most allocated during the last step"),
        ("capacity", m.capacity, "device total, --gpu-memory-limit, or the CPU budget"),
        ("device free", m.device_free, "cudaMemGetInfo: free on the whole device, other processes included"),
        ("NVML used (this process)", m.nvml_used, "what the driver charges this process"),
        ("NVML - reserved", m.nvml_gap, "CUDA context, cuBLAS/cuDNN/NCCL workspaces: outside PyTorch"),
        ("NVML used (device)", m.nvml_device_used, "every process on the device"),
        ("parameters", m.params, "CPU tracking"),
        ("gradients", m.grads, "CPU tracking (freed after each optimizer step)"),
        ("optimizer state", m.optimizer, "CPU tracking (appears at the first step)"),
        ("saved activations", m.activations, "CPU tracking (freed by backward)"),
        ("RSS", m.rss, "this process's resident memory (host)"),
    ]
    for name, value, meaning in rows:
        if value is not None:
            table.add_row(name, format_bytes(value), meaning)
    table.add_row(
        "alloc retries",
        format_figure(m.alloc_retries, ""),
        "the allocator freed its cache to satisfy a request: slow, a warning sign",
    )
    table.add_row("OOMs", str(v.ooms), "seen in this run (recovered or not)")
    if s.host is not None:
        h = s.host
        table.add_row("system memory", f"{format_bytes(h.system_used)} / {format_bytes(h.system_total)}", "host")
        table.add_row("CPU", format_figure(h.cpu_percent, " %", ".0f"), "this process, 100% = one core")
    parts: list[RenderableType] = [Text(f"Memory at step {s.step} on {m.device}", style="bold underline"), table]
    if v.cuda_summary:
        parts += [Text(""), Text("torch.cuda.memory_summary()", style="bold underline"), Text(v.cuda_summary)]
    return Group(*parts)


class LogScreen(Overlay):
    """The script's own stdout and stderr, kept from the start of the run."""

    BINDINGS = [*Overlay.BINDINGS, Binding("l", "dismiss", "back", show=False)]

    def compose(self) -> ComposeResult:
        yield RichLog(id="output", highlight=False, markup=False, wrap=True, max_lines=10_000)
        yield Static(id="output-current")  # a line still being redrawn (a progress bar): it changes in place
        yield Footer()

    def __init__(self, output: OutputLog) -> None:
        super().__init__()
        self.output = output
        self._position = 0  # lines of the output already shown

    def on_mount(self) -> None:
        self.call_after_refresh(self.update)  # is_mounted only turns true after on_mount

    def update(self) -> None:
        if not self.is_mounted:
            return
        lines, self._position = self.output.since(self._position)
        log = self.query_one(RichLog)
        for text in lines:
            log.write(text)
        current = self.output.current
        line = self.query_one("#output-current", Static)
        if current:
            line.update(Text(current, no_wrap=True, overflow="ellipsis"))
        elif not self.output.total:
            line.update(Text("the script has printed nothing yet: its stdout and stderr appear here", style="dim"))
        line.display = bool(current) or not self.output.total


class ConfirmQuit(ModalScreen[bool]):
    """Stop and quit? With what stopping does to this script (RunView.stop_effect), kept up to date:
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
        question, effect = self.view.stop_effect
        return f"{question}\n({effect})"

    def compose(self) -> ComposeResult:
        with Vertical(id="confirm"):
            yield Label(self._text(), id="confirm-text")
            with Horizontal(id="confirm-buttons"):
                yield Button(Text("[y] stop and quit"), id="yes", variant="error")
                yield Button(Text("[n] keep training"), id="no", variant="primary")

    def update(self) -> None:
        """Called by the app after each pull while this screen is on top."""
        if self.is_mounted:
            self.query_one("#confirm-text", Label).update(self._text())

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
