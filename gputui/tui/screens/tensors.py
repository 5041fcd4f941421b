"""The largest live tensors, by role."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.widgets import DataTable, Footer, Static

from ...telemetry.sample import Event
from ...units import format_bytes
from ..messages import RequestControl
from ..view import RunView
from .base import Overlay


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
