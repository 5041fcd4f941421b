"""What every panel of the main screen is made of.

A panel is given what it shows (the RunView, the script's output) and renders from it. After each
pull the screen has each panel take the key of what it shows (`shows()`) into `shown`, a Textual
reactive: a key that changed repaints the panel, the same key leaves it alone. The charts' panels
draw line by line (a LinePanel) and refresh only the lines that changed: a frame costs the same
however long the run. Also here: what several panels lay out with (flow, swatch, legend, axis).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from operator import attrgetter

from rich.console import Group, RenderableType
from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual import events
from textual.geometry import Region, Size
from textual.reactive import reactive
from textual.strip import Strip
from textual.widget import Widget

from ..chart import Chart, Row
from ..view import RunView

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

    shown: reactive[Hashable] = reactive(None, repaint=False, init=False)
    """The key of what the panel shows (set by redraw()): the same key, the same picture."""
    heading: reactive[Text | None] = reactive(None, repaint=False, init=False)
    """The border title the panel makes (set by redraw() and on a resize), where it makes one."""

    def shows(self) -> Hashable:
        """A cheap key of what the panel shows."""
        raise NotImplementedError

    def title(self) -> Text | None:
        """The border title, for a panel that makes its own (a chart's legend follows its lines)."""
        return None

    def redraw(self) -> None:
        """Take in what the panel shows now: it repaints if that changed (a resize redraws by itself)."""
        self.heading = self.title()
        self.shown = self.shows()

    def watch_shown(self) -> None:
        self.repaint()

    def watch_heading(self, title: Text | None) -> None:
        if title is not None:
            self.border_title = title  # which refreshes the panel: set only when it changed

    def repaint(self) -> None:
        """Draw what the panel shows anew."""
        height = self.styles.height
        self.refresh(layout=height is not None and height.is_auto)  # its lines may grow or shrink

    def on_resize(self, event: events.Resize) -> None:
        self.heading = self.title()  # a legend shortens on a narrow panel


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

    ended: reactive[tuple[int, bool] | None] = reactive(None, repaint=False, init=False)
    """(the run's generation, whether it has ended): set before the lines are made."""

    def __init__(self, view: RunView, chart: Chart, *, id: str | None = None) -> None:
        super().__init__(view, id=id)
        self.chart = chart

    def redraw(self) -> None:
        self.ended = (self.view.generation, not self.view.training)
        super().redraw()

    def watch_ended(self, ended: tuple[int, bool]) -> None:
        if ended[1]:
            self.chart.restart()


def axis(steps: list[int], width: int, extent: int, gutter: int = 8) -> Text:
    """The first and the last step under a chart, the last where its lines end (`extent` cells of
    the plot: the whole width until they are squeezed to make room for more points)."""
    if not steps:
        return Text("")
    left, right = f"step {steps[0]}", f"{steps[-1]}"
    pad = max(1, min(width, gutter + extent) - gutter - len(left) - len(right))
    return Text(" " * gutter + left + " " * pad + right, style="dim", no_wrap=True)
