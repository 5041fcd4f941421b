"""The main screen's panels. Each is given what it shows (the RunView, the script's output) and
renders from it; the screen asks each to redraw after a pull, which it does only when the key of
what it shows (`shows()`) changed since it last drew. The charts' panels draw line by line (a
LinePanel) and refresh only the lines that changed: a frame costs the same however long the run."""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Sequence
from itertools import groupby
from operator import attrgetter

from rich.console import Group, RenderableType
from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual import events
from textual.app import ComposeResult
from textual.geometry import Region, Size
from textual.strip import Strip
from textual.widget import Widget
from textual.widgets import Footer
from textual.widgets._footer import FooterKey  # the footer's key widget: textual.widgets does not export it

from ..telemetry.describe import number
from ..telemetry.output import OutputLog
from ..telemetry.sample import GpuDevice, HostReading, Memory
from ..units import format_bytes, format_bytes_short, format_clock, format_duration, format_figure
from .chart import Chart, Reader, Row, Series
from .keys import BY_ACTION, KEYS, shown
from .view import Ranks, RunView, share

# Segment styles of the memory bar (readable on dark and light themes: Rich named colours).
ALLOCATED, FRAGMENTED, CACHED, OTHER, FREE = "bold blue", "bold yellow", "cyan", "magenta", "dim"
PEAK = "yellow"  # the memory chart's step-peak line
RAW, SMOOTHED = "dim", "bold green"  # the loss chart's lines
WARN_AT = 0.90  # of capacity: the panel warns when the step peak passes it
GAP, DOT = "  ", " · "  # between the entries of a legend, between figures


def flow(items: Sequence[Text], width: int, gap: str = GAP) -> list[Text]:
    """The items on as few lines of `width` as they take, in order and each whole: a legend wraps
    between its entries, never inside one (an entry wider than the line is cut with an ellipsis)."""
    lines: list[Text] = []
    for item in items:
        if lines and lines[-1].cell_len + len(gap) + item.cell_len <= width:
            lines[-1].append(gap).append_text(item)
        else:
            lines.append(Text(no_wrap=True, overflow="ellipsis").append_text(item))
    return lines


def swatch(style: str, label: str) -> Text:
    """A legend entry: a square in the colour it names, then the label."""
    return Text().append("■", style=style).append(f" {label}")


def legend(title: str, lines: Sequence[tuple[str, str]]) -> Text:
    """A chart's border title: its name, then each line's mark in that line's colour."""
    text = Text(title)
    for label, style in lines:
        text.append(" ").append(f"━ {label}", style=style)
    return text


class Panel(Widget):
    """A widget drawn from data it was given; redrawn only when that data changed."""

    _drawn: Hashable = None
    _titled: Text | None = None

    def shows(self) -> Hashable:
        """A cheap key of what the panel shows: the same key, the same picture."""
        raise NotImplementedError

    def title(self) -> Text | None:
        """The border title, for a panel that makes its own (a chart's legend follows its lines)."""
        return None

    def redraw(self) -> None:
        """Refresh if what the panel shows changed since it last drew (a resize redraws by itself)."""
        self._retitle()
        key = self.shows()
        if key != self._drawn:
            self._drawn = key
            self.repaint()

    def repaint(self) -> None:
        """Draw what the panel shows anew."""
        height = self.styles.height
        self.refresh(layout=height is not None and height.is_auto)  # its lines may grow or shrink

    def on_resize(self, event: events.Resize) -> None:
        self._retitle()  # a legend shortens on a narrow panel

    def _retitle(self) -> None:
        title = self.title()
        if title is not None and title != self._titled:
            self._titled = title
            self.border_title = title


class RunPanel(Panel):
    def __init__(self, view: RunView, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.view = view


class LinePanel(RunPanel):
    """A panel drawn line by line (Textual's line API): each line kept as a Strip, made again only
    when its text changed, and a redraw refreshes only the lines that changed (a chart gaining a
    point changes a few). Its lines are Rich Text, or a chart's rows."""

    def __init__(self, view: RunView, *, id: str | None = None) -> None:
        super().__init__(view, id=id)
        self._items: list[Text | Row] = []  # what make_lines() gave, and the strips each made
        self._made: list[list[Strip]] = []
        self._strips: list[Strip] = []  # the panel's lines
        self._made_at: tuple[Size, Style] | None = None  # content size and base style the strips were made at

    def make_lines(self, width: int, height: int) -> list[Text | Row]:
        """What the panel shows, top to bottom: a Text (one line or more) or a chart's row."""
        raise NotImplementedError

    def repaint(self) -> None:
        if self._made_at != (self.content_size, self.visual_style.rich_style):
            self.refresh()  # not drawn at this size yet: render_line makes every line
            return
        changed = self._update()
        if changed:
            width = self.content_size.width
            self.refresh(*(Region(0, y, width, end - y) for y, end in changed))

    def render(self) -> RenderableType:
        """The lines as one renderable, for what reads a widget whole (its text in tests, a selection);
        the screen draws the strips of render_line."""
        size = self.content_size
        lines = self.make_lines(size.width, size.height)
        return Group(*(line if isinstance(line, Text) else Text.assemble(*line) for line in lines))

    def render_line(self, y: int) -> Strip:
        if self._made_at != (self.content_size, self.visual_style.rich_style):
            self._update()
        if y < len(self._strips):
            return self._strips[y]
        return Strip.blank(self.content_size.width, self.visual_style.rich_style)

    def _update(self) -> list[tuple[int, int]]:
        """Make the lines anew, reusing the strips of those whose text is the same: the spans
        [start, end) of lines that changed."""
        size, base = self.content_size, self.visual_style.rich_style
        if self._made_at != (size, base):
            self._made_at, self._items, self._made = (size, base), [], []
        items = self.make_lines(size.width, size.height)
        made = [
            self._made[i] if i < len(self._items) and same(item, self._items[i]) else self._make(item, size.width)
            for i, item in enumerate(items)
        ]
        strips = [strip for group in made for strip in group][: size.height]
        old, self._items, self._made, self._strips = self._strips, items, made, strips
        changed: list[tuple[int, int]] = []
        for y in range(max(len(strips), len(old))):
            if y < len(strips) and y < len(old) and strips[y] is old[y]:
                continue
            if changed and changed[-1][1] == y:
                changed[-1] = (changed[-1][0], y + 1)
            else:
                changed.append((y, y + 1))
        return changed

    def _make(self, item: Text | Row, width: int) -> list[Strip]:
        base = self.visual_style.rich_style
        if isinstance(item, Text):  # as Textual renders a Rich renderable, in the widget's style
            options = self.app.console_options.update(width=width, highlight=False)
            return [Strip(line) for line in self.app.console.render_lines(item, options, style=base, pad=False)]
        strip = Strip([Segment(text, base + style) for text, style in item])
        return [strip.crop(0, width) if strip.cell_length > width else strip]


_LOOK = attrgetter("style", "justify", "overflow", "no_wrap", "end")  # what a Text's == leaves out


def same(a: Text | Row, b: Text | Row) -> bool:
    """Whether two lines look the same (a Text's == compares only its characters and spans)."""
    if isinstance(a, Text) and isinstance(b, Text):
        return a == b and _LOOK(a) == _LOOK(b)
    return a == b


class ChartPanel(LinePanel):
    """A panel with a chart, drawn anew over the whole width once the run has ended."""

    def __init__(self, view: RunView, chart: Chart, *, id: str | None = None) -> None:
        super().__init__(view, id=id)
        self.chart = chart
        self._ended: tuple[int, bool] | None = None

    def read(self, series: list[Series], width: int) -> None:
        ended = (self.view.generation, not self.view.training)
        if ended != self._ended:
            self._ended = ended
            if ended[1]:
                self.chart.restart()
        self.chart.read(series, width)


class HeaderBar(LinePanel):
    """One line; on a narrow terminal the least needed parts go first (device, elapsed, ETA...)."""

    STATUS_STYLES = {
        "training": "bold green",
        "failed": "bold red",
        "OOM: waiting": "bold red",
        "paused": "bold yellow",
        "stopping": "bold yellow",
    }

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
        parts += [
            (0, "│ ", ""),
            (0, status, self.STATUS_STYLES.get(status, "bold")),
        ]
        if s is not None:
            total, epochs = v.total_steps, v.epochs
            parts.append((1, f" │ step {s.step}" + (f"/{total}" if total else ""), ""))
            if not v.observed or s.epoch:  # an own loop's, once a pass of its data ended
                parts.append((4, f" · epoch {s.epoch + 1}" + (f"/{epochs}" if epochs else ""), ""))
            if s.samples_per_s:
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


class MemoryPanel(ChartPanel):
    """The device's capacity as one bar, the figures beside it, and the run's memory history."""

    def __init__(self, view: RunView, *, id: str | None = None) -> None:
        super().__init__(view, Chart(label=format_bytes_short), id=id)

    def shows(self) -> Hashable:
        return self.view.generation, self.view.samples_seen, self.view.ooms, self.view.exit_code, self.view.training

    def title(self) -> Text:
        if not self.view.samples_seen:
            return Text("memory")
        wide = self.size.width >= 50
        lines = [("reserved" if wide else "resv", CACHED)] if len(self.view.series.reserved) else []
        lines.append(("peak", PEAK))
        cpu = self.view.latest is not None and self.view.latest.memory.reserved is None
        lines.append(("tracked" if cpu else "allocated" if wide else "alloc", ALLOCATED))
        return legend("memory", lines)

    def make_lines(self, width: int, height: int) -> list[Text | Row]:
        v = self.view
        m = v.latest.memory if v.latest else None
        if m is None:
            if v.exit_code is not None:
                return [Text("no training step: the script ended\nl shows what it printed", style="dim")]
            return [Text("waiting for the first step…", style="dim")]
        host = v.latest.host if v.latest else None
        lines: list[Text | Row] = [memory_bar(m, width, host)]
        lines.extend(memory_figures(m, width, v.ooms, host))
        warning = memory_warning(m, width, remedies=not v.observed)
        if warning:
            lines.extend(Text(warning, style="bold red").wrap(self.app.console, width))
        rows = height - len(lines) - 1
        if rows >= 2:
            h = v.series
            series = [Series(h.reserved.values, CACHED, peaks=True)] if len(h.reserved) else []
            series += [Series(h.peak.values, PEAK, peaks=True), Series(h.allocated.values, ALLOCATED, peaks=True)]
            self.read(series, width)
            peak = self.chart.span(len(series) - 2)[1]
            top = m.capacity if m.capacity and m.capacity < 2 * max(peak, 0) else None
            lines.extend(self.chart.draw(rows, low=0, high=top))
            lines.append(axis(h.allocated.steps, width, self.chart.extent))
        return lines


def memory_bar(m: Memory, width: int, host: HostReading | None = None) -> Text:
    """[allocated|fragmented|cached|other|free] over the capacity, the step peak marked with ┃.

    A CPU without a budget has no capacity but the machine's: the bar is then system memory,
    with the training state, the rest of this process and the other processes in it."""
    capacity = m.capacity or (host.system_total if host else None) or m.rss or m.allocated or 1
    if m.reserved is None and not m.capacity and host is not None and host.rss and host.system_used:
        state = m.allocated or 0
        parts = [(state, ALLOCATED), (max(0, host.rss - state), CACHED), (max(0, host.system_used - host.rss), OTHER)]
    elif m.reserved is not None:  # a caching allocator: CUDA, MPS
        fragmented = min(m.fragmented or 0, m.cached_free or 0)
        parts = [(m.allocated or 0, ALLOCATED), (fragmented, FRAGMENTED), ((m.cached_free or 0) - fragmented, CACHED)]
        used = m.reserved
        if m.nvml_device_used is not None and m.nvml_device_used > used:
            parts.append((m.nvml_device_used - used, OTHER))
            used = m.nvml_device_used
    else:  # CPU: tracked training state within the budget (or within RSS)
        parts = [(m.params or 0, ALLOCATED), (m.optimizer or 0, CACHED), ((m.grads or 0) + (m.activations or 0), OTHER)]
        used = m.allocated or 0
    count = max(4, width)
    cells: list[tuple[str, str]] = []
    for size, style in parts:
        n = max(0, min(round(min(size / capacity, 1.0) * count), count - len(cells)))
        cells += [("█", style)] * n
    cells += [("░", FREE)] * (count - len(cells))
    if m.peak:
        share = m.peak / capacity  # clamped where it is placed: a job's 1e308 over 0.5 is inf
        at = min(count - 1, round(max(0.0, min(share, 1.0)) * count))
        cells[at] = ("┃", "bold red" if share >= WARN_AT else "bold")
    text = Text(no_wrap=True)
    for (char, style), run in groupby(cells):
        text.append(char * len(list(run)), style=style)
    return text


def memory_figures(m: Memory, width: int, ooms: int, host: HostReading | None = None) -> list[Text]:
    """The bar's legend with its figures, then the peak and counters, each wrapped between entries
    to the panel's width: short labels and sizes below 56 columns, the details that fit above."""
    long = width >= 56
    size = format_bytes if long else format_bytes_short
    oom_count = max(ooms, m.ooms or 0)
    counted = Text(f"OOMs {oom_count}", style="bold red" if oom_count else "")
    if m.reserved is not None:
        entries = [
            swatch(ALLOCATED, f"{'allocated' if long else 'alloc'} {size(m.allocated)}"),
            swatch(CACHED, f"{'reserved' if long else 'resv'} {size(m.reserved)}"),
            swatch(FRAGMENTED, f"{'fragmented' if long else 'frag'} {size(m.fragmented)}"),
        ]
        figures = [Text(f"peak {size(m.peak)}" + (f" of {size(m.capacity)}" if m.capacity else ""))]
        if long or m.alloc_retries:  # none is the usual case: a narrow panel says so only when there are
            figures.append(Text(f"retries {m.alloc_retries or 0}", style="bold red" if m.alloc_retries else ""))
        lines = flow(entries, width) + flow([*figures, counted], width, DOT)
        if m.nvml_gap is not None:
            nvml = swatch(OTHER, f"NVML {size(m.nvml_used)}: +{size(m.nvml_gap)} outside PyTorch")
            detail = " (CUDA context, libraries)"
            if nvml.cell_len + len(detail) <= width:
                nvml.append(detail)
            lines += flow([nvml], width)
        elif m.nvml_device_used is not None:
            lines += flow([swatch(OTHER, f"NVML device used {size(m.nvml_device_used)} (all processes)")], width)
        return lines
    figures = [Text(f"tracked {size(m.allocated)}")]
    if m.capacity or host is None or not host.system_total:
        acts = None if m.grads is None and m.activations is None else (m.grads or 0) + (m.activations or 0)
        entries = [
            swatch(ALLOCATED, f"params {size(m.params)}"),
            swatch(CACHED, f"optim {size(m.optimizer)}"),
            swatch(OTHER, "grads+acts" + (f" {size(acts)}" if acts is not None else "")),
        ]
        budget = (f" / {size(m.capacity)} budget" if long else f" of {size(m.capacity)}") if m.capacity else ""
        figures.append(Text(f"peak {size(m.peak)}{budget}"))
        figures.append(Text(f"RSS {size(m.rss)}", style="dim"))
    else:  # the bar is the machine's memory
        others = (host.system_used or 0) - (host.rss or 0)
        entries = [
            swatch(ALLOCATED, f"{'training state' if long else 'state'} {size(m.allocated)}"),
            swatch(CACHED, f"{'process' if long else 'proc'} {size(host.rss)}"),
            swatch(OTHER, f"{'other processes' if long else 'others'} {size(others)}"),
        ]
        figures.append(Text(f"peak {size(m.peak)}"))
        figures.append(Text(f"system {size(host.system_used)} / {size(host.system_total)}"))
    return flow(entries, width) + flow([*figures, Text(f"OOMs {ooms}", style="bold red" if ooms else "")], width, DOT)


def memory_warning(m: Memory, width: int, remedies: bool = True) -> str | None:
    """The step peak near the capacity, with the keys that lower it (fit's run only: an own loop's
    keys cannot), named in full where the panel is wide enough."""
    if not m.capacity or not m.peak:
        return None
    share = m.peak / m.capacity
    if share < WARN_AT:
        return None
    if not remedies:
        return f"▲ step peak at {share:.0%} of capacity"
    if width >= 56:
        return f"▲ step peak at {share:.0%} of capacity: b halves the micro-batch, c checkpoints, a mixed precision"
    return f"▲ peak at {share:.0%} of capacity: b, c or a"


def axis(steps: list[int], width: int, extent: int, gutter: int = 8) -> Text:
    """The first and the last step under a chart, the last where its lines end (`extent` cells of
    the plot: the whole width until they are squeezed to make room for more points)."""
    if not steps:
        return Text("")
    left, right = f"step {steps[0]}", f"{steps[-1]}"
    pad = max(1, min(width, gutter + extent) - gutter - len(left) - len(right))
    return Text(" " * gutter + left + " " * pad + right, style="dim", no_wrap=True)


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


class LossTrend:
    """The loss panel's figures, extended by each new point (never recomputed over the whole run):
    the smoothed line (an exponential moving average with bias correction, as TensorBoard smooths),
    the lowest point, and the chart's top, the highest of the later 90% of the run (the first steps'
    loss is often far above the rest: the part being trained now is not squashed flat)."""

    def __init__(self, weight: float = 0.9) -> None:
        self.weight = weight
        self.reader = Reader()
        self.raw: Sequence[float] = []
        self.smoothed: list[float] = []
        self.best = 0  # the lowest point's index (its first)
        self._ema = 0.0
        self._later: deque[int] = deque()  # the later 90%'s indices that may yet be its highest, values falling

    def read(self, raw: Sequence[float]) -> None:
        start = self.reader.read(raw)
        if not start:  # a new list (the history halved, a new run): a new smoothed list too, for the chart
            self.smoothed, self.best, self._ema = [], 0, 0.0
            self._later.clear()
        self.raw = raw
        w = self.weight
        for i in range(start, len(raw)):
            v = raw[i]
            self._ema = w * self._ema + (1 - w) * v
            self.smoothed.append(self._ema / (1 - w ** (i + 1)))
            if v < raw[self.best]:
                self.best = i
            while self._later and raw[self._later[-1]] <= v:
                self._later.pop()
            self._later.append(i)
        while self._later and self._later[0] < len(raw) // 10:
            self._later.popleft()

    @property
    def top(self) -> float | None:
        """max(raw[len(raw) // 10:]), from 20 points on."""
        return self.raw[self._later[0]] if len(self.raw) >= 20 else None


class LossPanel(ChartPanel):
    def __init__(self, view: RunView, *, id: str | None = None) -> None:
        super().__init__(view, Chart(), id=id)
        self.trend = LossTrend()

    def shows(self) -> Hashable:
        return self.view.generation, self.view.samples_seen, self.view.exit_code, self.view.training

    def title(self) -> Text:
        return legend("loss", [("raw", RAW), ("smoothed", SMOOTHED)] if len(self.view.series.loss) else [])

    def make_lines(self, width: int, height: int) -> list[Text | Row]:
        v = self.view
        if not len(v.series.loss):
            ended = v.exit_code is not None
            return [Text("no loss was seen" if ended else "waiting for the first loss…", style="dim")]
        raw = v.series.loss.values
        self.trend.read(raw)
        smoothed, best = self.trend.smoothed, self.trend.best
        latest = v.latest.loss if v.latest and v.latest.loss is not None else raw[-1]
        head = [
            Text(f"{latest:.4g}", style="bold"),
            Text(f"smoothed {smoothed[-1]:.4g}", style="green"),
            Text(f"min {raw[best]:.4g} @ {v.series.loss.steps[best]}", style="dim"),
        ]
        if v.latest and v.latest.loss_source:  # an own loop: say where the loss was read
            head.append(Text(f"from {v.latest.loss_source}", style="italic"))
        lines: list[Text | Row] = list(flow(head, width))
        rows = height - len(lines) - 1
        if rows >= 2:
            self.read([Series(raw, RAW), Series(smoothed, SMOOTHED)], width)
            lines.extend(self.chart.draw(rows, high=self.trend.top))  # earlier points may touch the top
            lines.append(axis(v.series.loss.steps, width, self.chart.extent))
        return lines


OWN_LOOP_KEYS = (
    ("f", "free_cache", "free cache", "free"),
    ("s", "snapshot", "snapshot", "snap"),
    ("t", "top_tensors", "top tensors", "tensors"),
    ("p", "toggle_pause", "pause", "pause"),
)
"""The own-loop bar's keys (key, action, label, short label): it has no micro-batch, AMP or
checkpointing of gputui's to show (a key the run refuses is dimmed, and says why when pressed)."""


class RemediesBar(RunPanel):
    """The remedies in force, each after its key (dimmed when it cannot act now), and beside it what
    the key would lead to where the planner predicted it for the settings in force (`b 16×4 7.20 GiB ✓`).
    The entries stay whole: shorter labels where they save a line, else a second line; a wide bar adds
    why the dimmed keys cannot act (narrower ones say it when the key is pressed)."""

    def __init__(self, view: RunView, watch_only: str | None, *, id: str | None = None) -> None:
        super().__init__(view, id=id)
        self.watch_only = watch_only

    def shows(self) -> Hashable:
        v, s = self.view, self.view.latest
        batch = (s.micro_batch, s.accumulation, s.batch_size) if s else None
        dimmed = tuple(v.why_not(k.action, self.watch_only) for k in KEYS if k.control)
        return v.observed, batch, v.amp, v.checkpointing, v.auto_recover, len(v.pending), dimmed, v.plans

    def render(self) -> RenderableType:
        width = max(1, self.content_size.width)
        long, short = flow(self.entries(long=True), width), flow(self.entries(long=False), width)
        return Text("\n").join(short if len(short) < len(long) else long)

    def entries(self, *, long: bool) -> list[Text]:
        v, s = self.view, self.view.latest

        def key(k: str, action: str, label: str, style: str = "bold") -> Text:
            dim = v.why_not(action, self.watch_only) is not None
            return Text().append(f"[{k}]", style="dim" if dim else "bold reverse").append(f" {label}", style=style)

        wide = self.content_size.width >= 140
        if v.observed:
            entries = [Text("own loop, observed:", style="bold")]
            entries += [key(k, action, label if long else short, "") for k, action, label, short in OWN_LOOP_KEYS]
            needs = "b B a c o (batch, AMP, checkpointing, auto-recover)" if wide else "b a c o"
            entries.append(Text(f"· {needs} need gputui.fit (README: Adopting fit)", style="dim"))
            actions = [action for _, action, _, _ in OWN_LOOP_KEYS]
        else:
            mb = "micro-batch" if long else "mb"
            entries = [
                key("b/B", "halve_batch", f"{mb} {s.micro_batch} × {s.accumulation} = {s.batch_size}")
                if s
                else key("b/B", "halve_batch", f"{mb} –", ""),
                *self.predictions("bB", long),
                key("a", "cycle_amp", f"AMP {v.amp or '–'}"),
                *self.predictions("a", long),
                key("c", "toggle_checkpointing", f"{'checkpointing' if long else 'ckpt'} {on_off(v.checkpointing)}"),
                *self.predictions("c", long),
                key("o", "toggle_auto_recover", f"{'auto-recover' if long else 'auto'} {on_off(v.auto_recover)}"),
            ]
            if v.pending:
                entries.append(Text(f"→ {len(v.pending)} pending", style="yellow"))
            actions = ["halve_batch", "double_batch", "cycle_amp", "toggle_checkpointing", "toggle_auto_recover"]
        if wide:  # why the dimmed keys cannot act, each reason once (narrower: when the key is pressed)
            reasons: dict[str, list[str]] = {}
            for action in actions:
                reason = v.why_not(action, self.watch_only)
                if reason:
                    reasons.setdefault(reason, []).append(shown(BY_ACTION[action]))
            entries += [Text(f"· {' '.join(keys)}: {reason}", style="dim italic") for reason, keys in reasons.items()]
        return entries

    def predictions(self, keys: str, long: bool) -> list[Text]:
        """`b 16×4 7.20 GiB ✓` for each of the keys with a fresh prediction: the setting it switches
        to, the predicted step peak (`~`: estimated, not traced), whether it fits (no mark: the
        capacity is unknown)."""
        size = format_bytes if long else format_bytes_short
        entries = []
        for k in keys:
            o = self.view.predicted(k)
            if o is None:
                continue
            setting = {"a": o.get("amp"), "c": on_off(bool(o.get("checkpointing")))}.get(
                k, f"{o.get('micro_batch', '?')}×{o.get('accumulation', '?')}"
            )
            peak = number(o.get("peak"))
            text = Text().append(k, style="bold")
            text.append(f" {setting} {'' if o.get('exact') else '~'}{'?' if peak is None else size(peak)}")
            if isinstance(o.get("fits"), bool):
                text.append(" ✓" if o["fits"] else " ✗", style="bold green" if o["fits"] else "bold red")
            entries.append(text)
        return entries


def on_off(flag: bool) -> str:
    return "on" if flag else "off"


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


class GpuLine(RunPanel):
    """NVML's view of the GPUs: the training device first, with the gap PyTorch cannot see."""

    def shows(self) -> Hashable:
        return self.view.gpus

    def render(self) -> RenderableType:
        reading = self.view.gpus
        if reading is None:
            return Text("")
        if reading.status:
            return Text(f"NVML: {reading.status}", style="dim", no_wrap=True, overflow="ellipsis")
        text = Text(no_wrap=True, overflow="ellipsis")
        for i, device in enumerate(reading.devices):
            if i:
                text.append("  ")
            text.append_text(gpu_summary(device))
        return text


def gpu_summary(d: GpuDevice) -> Text:
    text = Text()
    text.append(f"GPU{d.index} ", style="bold")
    if d.error:
        return text.append(d.error, style="red")
    text.append(f"{(d.name or '').removeprefix('NVIDIA ')} ")
    text.append(f"{format_figure(d.utilization, '%')} ")
    text.append(f"{format_figure(d.temperature, '°C')} ")
    text.append(f"{format_figure(d.power, '', '.0f')}/{format_figure(d.power_limit, '', '.0f')}W ")
    text.append(f"used {format_bytes_short(d.memory_used)}/{format_bytes_short(d.memory_total)}")
    return text


class KeysFooter(Footer):
    """Textual's footer, fitted to the width as the header is: compact when the keys do not fit
    with room around them, then the keys go in DROP_ORDER (the remedies bar shows the first five
    with their keys already); `?` help and `q` quit always stay."""

    DROP_ORDER = (
        "double_batch",
        "toggle_auto_recover",
        "toggle_checkpointing",
        "cycle_amp",
        "halve_batch",
        "plan",
        "command_palette",
        "snapshot",
        "free_cache",
        "memory",
        "log",
        "toggle_pause",
        "top_tensors",
    )

    def compose(self) -> ComposeResult:
        hidden = self._fit()
        for widget in super().compose():
            if isinstance(widget, FooterKey):
                widget.display = _action(widget.action) not in hidden
            yield widget

    def on_resize(self, event: events.Resize) -> None:
        hidden = self._fit()
        for widget in self.query(FooterKey):
            widget.display = _action(widget.action) not in hidden

    def _fit(self) -> set[str]:
        """Set compact if needed; the actions whose keys do not fit even then."""
        width = self.size.width
        if not width or not self.is_attached:
            return set()
        keys = {
            _action(binding.action): (len(self.app.get_key_display(binding)), len(binding.description))
            for _, binding, _, _ in self.screen.active_bindings.values()
            if binding.show
        }
        palette = self.screen.active_bindings.get(self.app.COMMAND_PALETTE_BINDING)
        if palette is not None and self.show_command_palette and self.app.ENABLE_COMMAND_PALETTE:
            # docked right, after a border: two cells more than a key
            keys["command_palette"] = (len(self.app.get_key_display(palette[1])), len(palette[1].description) + 2)
        # A key takes " k label " (compact: "k label" and a space after it).
        self.compact = sum(k + d + 3 for k, d in keys.values()) > width
        needed = sum(k + d + 2 for k, d in keys.values())
        hidden: set[str] = set()
        for action in self.DROP_ORDER:
            if needed <= width:
                break
            if action in keys:
                hidden.add(action)
                needed -= sum(keys[action]) + 2
        return hidden


def _action(action: str) -> str:
    """A binding's action without its namespace: "app.halve_batch" -> "halve_batch"."""
    return action.rpartition(".")[2]
