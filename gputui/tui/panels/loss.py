"""The loss panel: the latest, smoothed and lowest loss, and the run's loss chart; under it the gradient
norm (fit's loop), its highest and the clip, and its own small chart, where spikes show."""

from __future__ import annotations

import math
from bisect import bisect_right
from collections import deque
from collections.abc import Hashable, Iterable, Sequence

from rich.text import Text

from ..chart import Chart, Reader, Row, Series
from ..view import RunView
from .base import ChartPanel, axis, flow, legend

RAW, SMOOTHED, EVAL = "dim", "bold green", "bold magenta"  # the loss chart's lines
NORM = "yellow"  # the gradient norm's line


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


class EvalLine:
    """The eval line on the loss chart: at each loss point, the latest evaluation at or before its
    step (NaN, no point, before the first), so it lies on the loss points' x positions. Extended with
    each new loss point; made anew when an evaluation comes (rare: a new list, which the chart reads
    whole) or the loss list is replaced (a halving, a new run)."""

    def __init__(self) -> None:
        self.reader = Reader()
        self.values: list[float] = []
        self.high = -math.inf  # the highest evaluation: the chart's top must not cut it
        self._seen = -1
        self._steps: list[int] = []
        self._evals: list[float] = []

    def read(self, steps: Sequence[int], evals: Iterable[tuple[int, float]], seen: int) -> list[float]:
        start = self.reader.read(steps)
        if seen != self._seen:
            self._seen, start = seen, 0
            self._steps, self._evals = [s for s, _ in evals], [v for _, v in evals]
            self.high = max((v for v in self._evals if not math.isnan(v)), default=-math.inf)
        if not start:
            self.values = []
        for step in steps[start:]:
            i = bisect_right(self._steps, step) - 1
            self.values.append(self._evals[i] if i >= 0 else math.nan)
        return self.values


class Highest:
    """The highest point of a series, extended by each new point (a History merges by max: it is kept)."""

    def __init__(self) -> None:
        self.reader = Reader()
        self.at = 0

    def read(self, values: Sequence[float]) -> int:
        """The highest point's index (its first)."""
        start = self.reader.read(values)
        if not start:
            self.at = 0
        for i in range(start, len(values)):
            if values[i] > values[self.at]:
                self.at = i
        return self.at


class LossPanel(ChartPanel):
    def __init__(self, view: RunView, *, id: str | None = None) -> None:
        super().__init__(view, Chart(), id=id)
        self.trend = LossTrend()
        self.evals = EvalLine()
        self.norms = Chart()
        self.highest = Highest()

    def watch_ended(self, ended: tuple[int, bool]) -> None:
        super().watch_ended(ended)
        if ended[1]:
            self.norms.restart()

    def shows(self) -> Hashable:
        v = self.view
        return v.generation, v.samples_seen, v.evals_seen, v.exit_code, v.training, v.skipped

    def title(self) -> Text:
        v = self.view
        lines = [("raw", RAW), ("smoothed", SMOOTHED)] if len(v.series.loss) else []
        if v.evals:
            lines.append((f"eval {v.evals[-1][1]:.4g}", EVAL))
        return legend("loss", lines)

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
        norm = self.norm_lines(width)
        rows = height - len(lines) - len(norm) - 1
        small = min(4, rows // 4) if norm else 0  # the norm's chart: a quarter of the rows, 2 to 4 of them
        small = small if small >= 2 else 0
        if rows - small >= 2:
            series = [Series(raw, RAW), Series(smoothed, SMOOTHED)]
            high = self.trend.top  # earlier points may touch the top, but no evaluation
            if v.evals:
                series.append(Series(self.evals.read(v.series.loss.steps, v.evals, v.evals_seen), EVAL, gaps=True))
                high = high if high is None else max(high, self.evals.high)
            self.chart.read(series, width)
            lines.extend(self.chart.draw(rows - small, high=high))
        lines.extend(norm)
        if rows - small >= 2:
            if small:
                norms, loss = v.series.grad_norm, v.series.loss
                if norms.steps == loss.steps:  # measured at every step (fit's): the list itself, read as it grows
                    self.norms.read([Series(norms.values, NORM, peaks=True)], width)
                else:  # for part of the run (fp16's scaler, a resumed run): under the loss's steps, gaps elsewhere
                    self.norms.read([Series(under(loss.steps, norms.steps, norms.values), NORM, True, True)], width)
                lines.extend(self.norms.draw(small, low=0.0))
            lines.append(axis(v.series.loss.steps, width, max(self.chart.extent, self.norms.extent)))
        return lines

    def norm_lines(self, width: int) -> list[Text]:
        """The gradient norm's figures (fit's loop measures it each step, before clipping): the latest, the
        highest, the clip, the fp16 steps skipped. None before a norm was seen (an own loop: never)."""
        v = self.view
        norms = v.series.grad_norm
        if not len(norms):
            return []
        measured = v.latest.grad_norm if v.latest is not None else None
        now = measured is not None  # else the last one measured, said where
        latest = measured if measured is not None else norms.values[-1]
        clip = v.info.clip_grad_norm if v.info else None
        over = clip is not None and latest > clip
        at = self.highest.read(norms.values)
        head = Text("grad norm ", style=NORM).append(f"{latest:.4g}", style="bold" + (" yellow" if over else ""))
        if not now:
            head.append(f" @ {norms.steps[-1]}", style="dim")
        figures = [head, Text(f"max {norms.values[at]:.4g} @ {norms.steps[at]}", style="dim")]
        if clip is not None:
            figures.append(Text(f"clip {clip:.4g}", style="yellow" if over else "dim"))
        if v.skipped:
            figures.append(Text(f"{v.skipped} fp16 step{'s' if v.skipped > 1 else ''} skipped", style="red"))
        return flow(figures, width)


def under(steps: Sequence[int], at: Sequence[int], values: Sequence[float]) -> list[float]:
    """`values` (measured at steps `at`) at the chart's points `steps`: each point the highest measured in
    its span (after the point before it, up to its own step), NaN where none was."""
    out, j, n = [], 0, len(at)
    for step in steps:
        best = math.nan
        while j < n and at[j] <= step:
            best = values[j] if math.isnan(best) else max(best, values[j])
            j += 1
        out.append(best)
    return out
