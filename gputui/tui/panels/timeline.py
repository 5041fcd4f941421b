"""The timeline: what happened at the step boundaries, newest first."""

from __future__ import annotations

from collections.abc import Hashable

from rich.console import Group, RenderableType
from rich.text import Text

from ...units import format_clock
from .base import RunPanel


class Timeline(RunPanel):
    STYLES = {
        "requested": "dim italic",
        "applied": "green",
        "refused": "yellow",
        "oom": "bold red",
        "error": "bold red",
        "info": "",
    }

    def shows(self) -> Hashable:
        return self.view.generation, self.view.entries

    def render(self) -> RenderableType:
        v = self.view
        height = max(1, self.content_size.height)
        if not v.timeline:
            return Text("events appear here: OOMs recovered, remedies applied, errors", style="dim")
        lines = []
        for entry in list(v.timeline)[:height]:
            line = Text(no_wrap=True, overflow="ellipsis")
            line.append(format_clock(entry.t) + " ", style="dim")
            line.append(f"{entry.step:>6} ", style="dim")
            line.append(entry.text, style=self.STYLES.get(entry.kind, ""))
            lines.append(line)
        return Group(*lines)
