"""The script's output, as a terminal would show it."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.widgets import Footer, RichLog, Static

from ...telemetry.output import OutputLog
from .base import Overlay


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

    def update(self) -> None:
        if not self.is_mounted:
            return
        lines, self._position = self.output.since(self._position)
        log = self.query_one(RichLog)
        for text in lines:
            # expand: the log's width, not the console's (80 columns where textual measures a line, so a
            # longer line wrapped there however wide the terminal)
            log.write(text, expand=True)
        current = self.output.current
        line = self.query_one("#output-current", Static)
        if current:
            line.update(Text(current, no_wrap=True, overflow="ellipsis"))
        elif not self.output.total:
            line.update(Text("the script has printed nothing yet: its stdout and stderr appear here", style="dim"))
        line.display = bool(current) or not self.output.total
