"""The memory panel: the device's capacity as one bar, its figures, and the run's memory history."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from itertools import groupby

from rich.text import Text

from ...telemetry.sample import HostReading, Memory
from ...units import format_bytes, format_bytes_short
from ..chart import Chart, Row, Series
from ..keys import BY_ACTION, shown
from ..view import RunView
from .base import DOT, ChartPanel, axis, flow, legend, swatch

# Segment styles of the memory bar (readable on dark and light themes: Rich named colours).
ALLOCATED, FRAGMENTED, CACHED, OTHER, FREE = "bold blue", "bold yellow", "cyan", "magenta", "dim"
PEAK = "yellow"  # the memory chart's step-peak line
WARN_AT = 0.90  # of capacity: the panel warns when the step peak passes it
HALVE, CHECKPOINTING, AMP, LOG = (  # the keys the panel names, as the user types them
    shown(BY_ACTION[action]) for action in ("halve_batch", "toggle_checkpointing", "cycle_amp", "log")
)


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
                return [Text(f"no training step: the script ended\n{LOG} shows what it printed", style="dim")]
            return [Text("waiting for the first step…", style="dim")]
        host = v.latest.host if v.latest else None
        lines: list[Text | Row] = [memory_bar(m, width, host)]
        lines.extend(memory_figures(m, width, v.ooms, host, v.info.unreadable if v.info else {}))
        warning = memory_warning(m, width, remedies=not v.observed)
        if warning:
            lines.extend(Text(warning, style="bold red").wrap(self.app.console, width))
        rows = height - len(lines) - 1
        if rows >= 2:
            h = v.series
            series = [Series(h.reserved.values, CACHED, peaks=True)] if len(h.reserved) else []
            series += [Series(h.peak.values, PEAK, peaks=True), Series(h.allocated.values, ALLOCATED, peaks=True)]
            self.chart.read(series, width)
            peak = self.chart.span(len(series) - 2)[1]
            top = m.capacity if m.capacity and m.capacity < 2 * max(peak, 0) else None
            lines.extend(self.chart.draw(rows, low=0, high=top))
            lines.append(axis(h.allocated.steps, width, self.chart.extent))
        return lines


def memory_bar(m: Memory, width: int, host: HostReading | None = None) -> Text:
    """[allocated|fragmented|cached|free] over the capacity, the step peak marked with ┃.

    A caching allocator's capacity is what it may hold (on CUDA: device free + reserved, under the
    limit), so the memory outside it (the CUDA context, other processes) is no part of the bar:
    the figures below say what NVML knows of it. A CPU without a budget has no capacity but the
    machine's: the bar is then system memory, with the training state, the rest of this process
    and the other processes in it."""
    capacity = m.capacity or (host.system_total if host else None) or m.rss or m.allocated or 1
    if m.reserved is None and not m.capacity and host is not None and host.rss and host.system_used:
        state = m.allocated or 0
        parts = [(state, ALLOCATED), (max(0, host.rss - state), CACHED), (max(0, host.system_used - host.rss), OTHER)]
    elif m.reserved is not None:  # a caching allocator: CUDA, MPS
        fragmented = min(m.fragmented or 0, m.cached_free or 0)
        parts = [(m.allocated or 0, ALLOCATED), (fragmented, FRAGMENTED), ((m.cached_free or 0) - fragmented, CACHED)]
    else:  # CPU: tracked training state within the budget (or within RSS)
        parts = [(m.params or 0, ALLOCATED), (m.optimizer or 0, CACHED), ((m.grads or 0) + (m.activations or 0), OTHER)]
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


def memory_figures(
    m: Memory, width: int, ooms: int, host: HostReading | None = None, unreadable: Mapping[str, str] | None = None
) -> list[Text]:
    """The bar's legend with its figures, then the peak and counters, each wrapped between entries
    to the panel's width: short labels and sizes below 56 columns, the details that fit above.
    A figure in `unreadable` (RunInfo's: the allocator does not count it) reads "n/a (why)", not 0."""
    long = width >= 56
    size = format_bytes if long else format_bytes_short
    unread = unreadable or {}

    def na(name: str) -> str:
        return f"n/a ({unread[name]})" if long else "n/a"

    oom_count = max(ooms, m.ooms or 0)
    counted = Text(f"OOMs {oom_count}", style="bold red" if oom_count else "")
    if m.reserved is not None:
        entries = [
            swatch(ALLOCATED, f"{'allocated' if long else 'alloc'} {size(m.allocated)}"),
            swatch(CACHED, f"{'reserved' if long else 'resv'} {size(m.reserved)}"),
            swatch(
                FRAGMENTED,
                f"{'fragmented' if long else 'frag'} "
                + (na("fragmented") if "fragmented" in unread else size(m.fragmented)),
            ),
        ]
        figures = [Text(f"peak {size(m.peak)}" + (f" of {size(m.capacity)}" if m.capacity else ""))]
        if "alloc_retries" in unread:
            if long:
                figures.append(Text(f"retries {na('alloc_retries')}", style="dim"))
        elif long or m.alloc_retries:  # none is the usual case: a narrow panel says so only when there are
            figures.append(Text(f"retries {m.alloc_retries or 0}", style="bold red" if m.alloc_retries else ""))
        return flow(entries, width) + flow([*figures, counted], width, DOT) + outside_pytorch(m, width, size)
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


def outside_pytorch(m: Memory, width: int, size: Callable[[int | None], str]) -> list[Text]:
    """What NVML says of the memory outside the bar: this process's beyond `reserved` and the other
    processes', where NVML names this pid; else only the device's whole "used", said to be that."""
    if m.nvml_gap is not None:
        nvml = Text(f"NVML {size(m.nvml_used)}: +{size(m.nvml_gap)} outside PyTorch")
        detail = " (CUDA context, libraries)"
        if nvml.cell_len + len(detail) <= width:
            nvml.append(detail)
        entries = [nvml]
        if m.nvml_others:
            entries.append(Text(f"other processes {size(m.nvml_others)}"))
        return flow(entries, width, DOT)
    if m.nvml_device_used is not None:
        unknown = "this process's share unknown: NVML lists no memory for its pid"
        if width < 56:
            unknown = "own share unknown"
        return flow([Text(f"NVML device used {size(m.nvml_device_used)}"), Text(unknown, style="dim")], width, DOT)
    return []


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
        return (
            f"▲ step peak at {share:.0%} of capacity: {HALVE} halves the micro-batch, {CHECKPOINTING} checkpoints, "
            f"{AMP} mixed precision"
        )
    return f"▲ peak at {share:.0%} of capacity: {HALVE}, {CHECKPOINTING} or {AMP}"
