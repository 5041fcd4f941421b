"""The header: the script, its device and rank, the status, the step, the speed, the time."""

from __future__ import annotations

from collections.abc import Hashable

from rich.text import Text

from ...units import format_duration
from ..chart import Row
from ..view import RunView
from .base import LinePanel


class HeaderBar(LinePanel):
    """One line; on a narrow terminal the least needed parts go first (device, elapsed, ETA...). An
    attached screen says whether it watches or steers: the same keys do nothing or change the job."""

    STATUS_STYLES = {
        "training": "bold green",
        "failed": "bold red",
        "OOM: waiting": "bold red",
        "paused": "bold yellow",
        "stopping": "bold yellow",
        "interrupted": "bold yellow",
    }

    def __init__(self, view: RunView, watch_only: str | None, *, id: str | None = None) -> None:
        super().__init__(view, id=id)
        self.watch_only = watch_only

    def parts(self) -> list[tuple[int, str, str]]:
        """(priority: lower survives longer, text, style), in display order, cut to the width."""
        v = self.view
        s = v.latest
        status = v.status
        device = (v.device_name or "…").removeprefix("NVIDIA ")
        parts: list[tuple[int, str, str]] = [
            (0, " gputui ", "bold reverse"),
            (0, f" {v.name} ", "bold"),
            (5, f"│ {device} ", ""),
        ]
        if v.rank is not None:  # each torchrun rank is its own run (and socket): which one this is stays
            parts.append((0, f"│ rank {v.rank[0]} of {v.rank[1]} ", ""))
        if v.remote:
            parts.append(
                (2, "│ watch-only " if self.watch_only else "│ steering ", "dim" if self.watch_only else "bold magenta")
            )
        parts += [
            (0, "│ ", ""),
            (0, status, "bold red" if status.startswith("waiting for") else self.STATUS_STYLES.get(status, "bold")),
        ]
        if s is not None:
            total, epochs = v.total_steps, v.epochs
            parts.append((1, f" │ step {s.step}" + (f"/{total}" if total else ""), ""))
            if not v.observed or s.epoch:  # an own loop's, once a pass of its data ended
                parts.append((4, f" · epoch {s.epoch + 1}" + (f"/{epochs}" if epochs else ""), ""))
            if status not in ("training", "stopping"):  # paused, waiting, ended, gone: no speed to show
                pass
            elif s.samples_per_s:
                parts.append((2, f" │ {s.samples_per_s:,.0f} samples/s", ""))
            elif s.steps_per_s:
                parts.append((2, f" │ {s.steps_per_s:,.1f} steps/s", ""))
        if v.eta is not None:
            parts.append((3, f" │ ETA {format_duration(v.eta)}", ""))
        parts.append((6, f" │ {format_duration(v.elapsed)}", "dim"))
        width = self.content_size.width or 80
        while sum(len(t) for _, t, _ in parts) > width and max(p for p, _, _ in parts) > 0:
            drop = max(p for p, _, _ in parts)
            parts = [part for part in parts if part[0] != drop]
        return parts

    def shows(self) -> Hashable:
        return tuple(self.parts())

    def make_lines(self, width: int, height: int) -> list[Text | Row]:
        text = Text(no_wrap=True, overflow="ellipsis")
        for _, part, style in self.parts():
            text.append(part, style=style)
        return [text]
