"""The help screen: every key, what it does, and what cannot act now and why."""

from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.widgets import Footer, Static

from ..keys import KEYS, shown
from .base import Overlay


class HelpScreen(Overlay):
    """`attached`: the screen of `gputui attach`, whose q and ctrl+c leave it and the job trains on."""

    BINDINGS = [*Overlay.BINDINGS, Binding("question_mark", "dismiss", "back", show=False)]

    def __init__(self, *, attached: bool = False) -> None:
        super().__init__()
        self.attached = attached

    def compose(self) -> ComposeResult:
        keys = Table.grid(padding=(0, 2))
        keys.add_column(style="bold", no_wrap=True)
        keys.add_column()
        leave = "Leave this screen; the job trains on (gputui attach again to come back)."
        for k in KEYS:
            keys.add_row(shown(k), leave if self.attached and k.action == "quit" else k.help)
        keys.add_row("ctrl+c", leave if self.attached else "Stop after the current step, then quit (twice: quit now).")
        keys.add_row("ctrl+p", "Command palette: every action above, searchable.")
        panels = Text.from_markup(
            "[b]Memory[/b]: the bar is the capacity, what this process can have (CUDA: the device's free "
            "memory plus reserved, at most --gpu-memory-limit; CPU: the budget, else the machine's memory). "
            "[blue]allocated[/] = live tensors; [cyan]reserved[/] = held by PyTorch's caching allocator "
            "(allocated + cached free); [yellow]fragmented[/] = freed pieces of segments still in use, which "
            "empty_cache cannot return; on a CPU [magenta]magenta[/] = gradients and activations (a budget) or "
            "other processes (the machine). Below it, NVML: this process beyond reserved (the CUDA context, "
            "cuBLAS/cuDNN/NCCL workspaces) and the other processes, or, where NVML lists no memory for this "
            "pid (a container), only the device's whole used. ┃ marks this step's peak; a red ┃ and a "
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
