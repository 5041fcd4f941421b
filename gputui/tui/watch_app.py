"""`gputui watch`: every GPU and every process on it, for jobs that gputui did not start.

The app only reads what a poller hands over (an NvmlPoller thread makes the NVML calls, so a
slow driver never stalls the UI) and re-renders only when the poller has a new reading. No
torch: watching must neither pay torch's import time nor create a CUDA context.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import Protocol

from rich.console import Group, RenderableType
from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.screen import ModalScreen
from textual.timer import Timer
from textual.widget import Widget
from textual.widgets import DataTable, Footer, Static

from ..telemetry.sample import GpuDevice, GpuProcess, GpuReading
from ..units import format_bytes, format_bytes_short, format_figure
from .panels.gpus import gpu_summary


class Poller(Protocol):
    def latest(self) -> GpuReading | None: ...


Row = tuple[int, GpuProcess]
"""One line of the process table: the GPU's index and the process NVML sees on it."""


def _memory_first(row: Row) -> tuple[bool, int, int, int]:
    """Largest first; hidden figures (containers, no permission) last, not mistaken for zero."""
    gpu, p = row
    return p.gpu_memory is None, -(p.gpu_memory or 0), gpu, p.pid


SORTS: dict[str, Callable[[Row], tuple[int | bool, ...]]] = {
    "memory": _memory_first,
    "pid": lambda row: (row[1].pid, row[0]),
    "gpu": lambda row: (row[0], *_memory_first(row)),
}

UTIL_CELLS = 10
NAME_WIDTH = 24  # a longer GPU name is cut: the figures after it stay in their columns
HELP = (
    "[b]gputui watch[/b]: every GPU and every process NVML sees on it, for any job.\n\n"
    "[b]q[/b]  quit\n"
    "[b]s[/b]  sort the processes by GPU memory (largest first), by PID, or by GPU\n"
    "[b]?[/b]  this help (escape closes it)\n\n"
    "[dim]n/a: NVML would not say. A GPU may not support a figure (power, temperature), and in a "
    "container or without permission NVML hides each process's memory (those sort last) and the "
    "host's PIDs (no user or command).[/dim]"
)


def process_rows(reading: GpuReading, sort: str) -> list[Row]:
    rows = [(device.index, p) for device in reading.devices for p in device.processes]
    return sorted(rows, key=SORTS[sort])


def bar(share: float | None, cells: int, style: str) -> Text:
    """`share` of `cells` filled; blank when unknown, so the figures after it stay aligned."""
    if share is None:
        return Text(" " * cells)
    filled = max(0, min(cells, round(share * cells)))
    return Text.assemble(("█" * filled, style), ("░" * (cells - filled), "dim"))


def memory_style(share: float) -> str:
    return "bold red" if share >= 0.95 else "yellow" if share >= 0.80 else "cyan"


def device_block(d: GpuDevice, width: int, name_width: int) -> list[Text]:
    """Two lines: name, utilisation, temperature, power; then memory as a bar across the width."""
    if d.error is not None:
        return [gpu_summary(d)]
    size = format_bytes if width >= 60 else format_bytes_short
    label = f"GPU{d.index} "
    name = (d.name or "n/a").removeprefix("NVIDIA ")[:name_width]
    head = Text(no_wrap=True, overflow="ellipsis")
    head.append(label, style="bold").append(f"{name:<{name_width}}  util ")
    head.append(f"{format_figure(d.utilization, '%'):>4} ", style="bold")
    head.append_text(bar(None if d.utilization is None else d.utilization / 100, UTIL_CELLS, "green"))
    head.append(f"  {format_figure(d.temperature, '°C'):>5}")
    head.append(f"  {format_figure(d.power, ' W', '.0f')} / {format_figure(d.power_limit, ' W', '.0f')}")
    share = d.memory_used / d.memory_total if d.memory_used is not None and d.memory_total else None
    figures = f" {size(d.memory_used)} / {size(d.memory_total)}"
    if share is not None:
        figures += f" ({share:.0%})"
    memory = Text(" " * len(label) + "mem ", no_wrap=True, overflow="ellipsis")
    memory.append_text(bar(share, max(4, width - len(memory) - len(figures)), memory_style(share or 0)))
    return [head, memory.append(figures)]


class DeviceList(Widget):
    """Every GPU of the reading it is given; rendered at the widget's width, so the bars follow a resize."""

    reading: GpuReading | None = None

    def render(self) -> RenderableType:
        reading = self.reading
        if reading is None:
            return Text("waiting for the first reading…", style="dim")
        if not reading.devices:
            return Text("NVML lists no GPU", style="dim")
        width = self.content_size.width or 80
        names = [len((d.name or "n/a").removeprefix("NVIDIA ")) for d in reading.devices if d.error is None]
        name_width = min(NAME_WIDTH, max(names, default=0))
        return Group(*(line for d in reading.devices for line in device_block(d, width, name_width)))


class WatchHelp(ModalScreen[None]):
    BINDINGS = [Binding("escape,question_mark,q", "dismiss", "close")]

    def compose(self) -> ComposeResult:
        yield Static(HELP, id="watch-help")


class WatchApp(App[int]):
    """`gputui watch`: pulls `poller.latest()` `refresh` times a second, never calls NVML itself."""

    TITLE = "gputui watch"
    CSS = """
    #header { height: 1; background: $panel; }
    #devices {
        height: auto;
        border: round $primary-muted;
        border-title-color: $text-primary;
        padding: 0 1;
    }
    #processes {
        height: 1fr;
        border: round $primary-muted;
        border-title-color: $text-primary;
    }
    #status {
        height: 1fr;
        border: round $error;
        content-align: center middle;
        text-align: center;
        padding: 1 2;
    }
    WatchHelp { align: center middle; background: $background 60%; }
    #watch-help {
        width: 90%;
        max-width: 96;
        height: auto;
        border: thick $primary;
        background: $surface;
        padding: 1 2;
    }
    """
    BINDINGS = [
        Binding("q", "quit", "quit"),
        Binding("ctrl+c", "quit", "quit", show=False, priority=True),
        Binding("s", "cycle_sort", "sort"),
        Binding("question_mark", "help", "help", key_display="?"),
    ]

    def __init__(self, poller: Poller, refresh: float = 1.0, *, host: str | None = None) -> None:
        super().__init__()
        self.poller = poller
        self.refresh_hz = refresh
        self.host = host or socket.gethostname()
        self.reading: GpuReading | None = None
        self.sort = "memory"
        self._first: Timer | None = None

    def compose(self) -> ComposeResult:
        yield Static(id="header")
        yield Static(id="status")
        yield DeviceList(id="devices")
        table: DataTable[str | Text] = DataTable(id="processes", cursor_type="row", zebra_stripes=True)
        table.add_column("GPU", key="gpu")
        table.add_column(Text("PID", justify="right"), key="pid")
        table.add_column("USER", key="user")
        table.add_column(Text("GPU MEM", justify="right"), key="memory")
        table.add_column("KIND", key="kind")
        table.add_column("COMMAND", key="command")
        yield table
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#devices").border_title = "GPUs"
        self.show()
        self.set_interval(1 / self.refresh_hz, self.pull)
        # The poller's first reading lands moments after it starts: do not leave the screen blank a whole period.
        self._first = self.set_interval(0.05, self._pull_first)

    def _pull_first(self) -> None:
        self.pull()
        if self.reading is not None and self._first is not None:
            self._first.stop()

    def pull(self) -> None:
        if not self.is_running:  # closing: under run_test the timers tick while the widgets are taken apart
            return
        reading = self.poller.latest()
        if reading is not None and reading is not self.reading:
            self.reading = reading
            self.show()

    def show(self) -> None:
        reading = self.reading
        status = reading.status if reading is not None else None
        with self.batch_update():
            self.query_one("#header", Static).update(self._header())
            self.query_one("#status", Static).update(
                Text.assemble(("NVML unavailable\n\n", "bold"), (status or "", "bold red"), ("\n\nq quits", "dim"))
            )
            self.query_one("#status").display = status is not None
            devices = self.query_one(DeviceList)
            devices.reading = reading
            devices.display = status is None
            devices.refresh(layout=True)
            table = self.query_one(DataTable)
            table.display = status is None
            self._fill(table)

    def _header(self) -> Text:
        text = Text(no_wrap=True, overflow="ellipsis")
        text.append(" gputui watch ", style="bold reverse").append(f" {self.host} ", style="bold")
        if self.reading is None:
            return text.append("│ waiting for the first reading…", style="dim")
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.reading.t))
        return text.append(f"│ driver {self.reading.driver or 'n/a'} │ {stamp}")

    def _fill(self, table: DataTable[str | Text]) -> None:
        """Rebuild the rows in the current order; the cursor stays on the process it was on."""
        rows = [] if self.reading is None else process_rows(self.reading, self.sort)
        kept = table.coordinate_to_cell_key(table.cursor_coordinate).row_key if table.row_count else None
        table.clear()
        for gpu, p in rows:
            table.add_row(
                str(gpu),
                Text(str(p.pid), justify="right"),
                p.user or "n/a",
                Text(format_bytes(p.gpu_memory), justify="right"),
                p.kind,
                p.command or "n/a",
                key=f"{gpu}:{p.pid}",
            )
        if kept in table.rows:
            table.move_cursor(row=table.get_row_index(kept))
        table.border_title = f"processes ({len(rows)}) · sorted by {self.sort}"

    def action_cycle_sort(self) -> None:
        names = list(SORTS)
        self.sort = names[(names.index(self.sort) + 1) % len(names)]
        self._fill(self.query_one(DataTable))

    def action_help(self) -> None:
        self.push_screen(WatchHelp())
