"""The ranks of a torchrun job, one line each: how close each is to its OOM."""

from __future__ import annotations

from collections.abc import Hashable

from rich.console import RenderableType
from rich.text import Text

from ...units import format_bytes, format_bytes_short
from ..ranks import Ranks, share
from .base import GAP, RunPanel
from .memory import ALLOCATED, FREE, WARN_AT


class RanksPanel(RunPanel):
    """Every rank of a torchrun job, one line each: its step peak as a bar of its capacity, its
    micro-batch; the worst rank (closest to its OOM, which comes first there) highlighted, this
    screen's rank marked. Many ranks: the worst few and this one, in as many lines as the
    terminal's height spares, and how many are left out."""

    def lines(self) -> int:
        height = self.screen.size.height
        return 3 if height < 30 else 5 if height < 45 else 9

    def shows(self) -> Hashable:
        return self.view.ranks(self.lines())

    def title(self) -> Text:
        ranks = self.view.job_ranks
        if not ranks:
            return Text("ranks")
        parts = [f"ranks · {len(ranks)} in the job"]
        rates = [r.samples_per_s for r in ranks if r.samples_per_s is not None]
        if len(rates) == len(ranks):  # the job's speed: every rank's share at once
            parts.append(f"{sum(rates):,.0f} samples/s in all")
        losses = [r.loss for r in ranks if r.loss is not None]
        if len(losses) == len(ranks):
            parts.append(f"mean loss {sum(losses) / len(losses):.4g}")
        return Text(" · ".join(parts))

    def render(self) -> RenderableType:
        ranks = self.view.ranks(self.lines())
        if ranks is None:
            return Text("")
        return Text("\n").join(rank_lines(ranks, max(20, self.content_size.width)))


def rank_lines(ranks: Ranks, width: int) -> list[Text]:
    """One line a rank, in aligned columns, the bar taking the room the others leave; then how many
    ranks are not shown and how close the closest of them comes."""
    long = width >= 100
    size = format_bytes if long else format_bytes_short
    scale = max((r.peak or 0 for r in ranks.shown), default=0) or 1  # the bars of ranks whose capacity is unknown

    def figures(peak: int | None, capacity: int | None) -> str:
        if peak is None:
            return "peak –"
        if not capacity:
            return f"peak {size(peak)}"
        return f"{size(peak)} / {size(capacity)} {peak / capacity:>4.0%}"

    labels = [f"rank {r.rank}" for r in ranks.shown]
    sizes = [figures(r.peak, r.capacity) for r in ranks.shown]
    batches = [f"{'micro-batch' if long else 'mb'} {r.micro_batch}" for r in ranks.shown]
    marks = [
        " · ".join(m for m, on in (("◀ worst", r.rank == ranks.worst), ("this", r.rank == ranks.this)) if on)
        for r in ranks.shown
    ]
    columns = [max(map(len, column)) for column in (labels, sizes, batches, marks)]
    bar = max(4, width - sum(columns) - len(GAP) * 4)
    lines = []
    for r, label, figure, batch, mark in zip(ranks.shown, labels, sizes, batches, marks, strict=True):
        worst = r.rank == ranks.worst
        part = share(r)
        hot = "bold red" if part is not None and part >= WARN_AT else "bold yellow"
        filled = 0 if r.peak is None else round(max(0.0, min(part if part is not None else r.peak / scale, 1.0)) * bar)
        line = Text(no_wrap=True, overflow="ellipsis")
        line.append(label.ljust(columns[0]), style="bold" if worst or r.rank == ranks.this else "")
        line.append(GAP).append("█" * filled, style=hot if worst else ALLOCATED).append(
            "░" * (bar - filled), style=FREE
        )
        line.append(GAP).append(figure.rjust(columns[1]), style="bold" if worst else "")
        line.append(GAP).append(batch.ljust(columns[2]))
        line.append(GAP).append(mark.ljust(columns[3]), style=hot if worst else "bold")
        lines.append(line)
    if ranks.hidden:
        note = f"+ {ranks.hidden} more rank{'s' if ranks.hidden > 1 else ''} not shown"
        closest = ranks.hidden_worst
        if closest is not None and closest.peak is not None:
            part = share(closest)
            note += (
                f", none above {part:.0%} of capacity" if part is not None else f", peaks up to {size(closest.peak)}"
            )
        lines.append(Text(note, style="dim", no_wrap=True, overflow="ellipsis"))
    return lines
