"""The script's latest output lines (an own loop's run shows them on the main screen)."""

from __future__ import annotations

from collections.abc import Hashable

from rich.console import RenderableType
from rich.text import Text

from ...telemetry.output import OutputLog
from .base import Panel


class LogPanel(Panel):
    """The script's latest output lines (own-loop runs show it on the main screen)."""

    def __init__(self, output: OutputLog, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.output = output

    def shows(self) -> Hashable:
        return self.output.total, self.output.current

    def render(self) -> RenderableType:
        height, width = max(1, self.content_size.height), max(1, self.content_size.width)
        lines = self.output.tail(height)
        if not lines:
            return Text("the script's output appears here", style="dim")
        # Each line from its start, wrapped as a terminal would; the newest rows at the bottom.
        rows = [row for line in lines for row in Text(line).wrap(self.app.console, width, overflow="fold")]
        return Text("\n").join(rows[-height:])
