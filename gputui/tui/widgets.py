"""The main screen's panels. Each is given what it shows (the RunView, the script's output) and
renders from it; the screen asks each to redraw after a pull, which it does only when the key of
what it shows (`shows()`) changed since it last drew."""

from __future__ import annotations

import time
from collections.abc import Hashable

from rich.console import Group, RenderableType
from rich.text import Text
from textual.widget import Widget

from ..telemetry.sample import GpuDevice, HostReading, Memory
from ..units import format_bytes, format_bytes_short, format_duration, format_figure
from .chart import Series, plot, smooth
from .keys import KEYS
from .output import OutputLog
from .view import RunView

# Segment styles of the memory bar (readable on dark and light themes: Rich named colours).
ALLOCATED, FRAGMENTED, CACHED, OTHER, FREE = "bold blue", "bold yellow", "cyan", "magenta", "dim"
WARN_AT = 0.90  # of capacity: the panel warns when the step peak passes it


class Panel(Widget):
    """A widget drawn from data it was given; redrawn only when that data changed."""

    _drawn: Hashable = None

    def shows(self) -> Hashable:
        """A cheap key of what the panel shows: the same key, the same picture."""
        raise NotImplementedError

    def redraw(self) -> None:
        """Refresh if what the panel shows changed since it last drew (a resize redraws by itself)."""
        key = self.shows()
        if key != self._drawn:
            self._drawn = key
            self.refresh()


class RunPanel(Panel):
    def __init__(self, view: RunView, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.view = view


class HeaderBar(RunPanel):
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

    def render(self) -> RenderableType:
        text = Text(no_wrap=True, overflow="ellipsis")
        for _, part, style in self.parts():
            text.append(part, style=style)
        return text


class MemoryPanel(RunPanel):
    """The device's capacity as one bar, the figures beside it, and the run's memory history."""

    def shows(self) -> Hashable:
        return self.view.generation, self.view.samples_seen, self.view.ooms

    def render(self) -> RenderableType:
        v = self.view
        width, height = self.content_size.width, self.content_size.height
        m = v.latest.memory if v.latest else None
        if m is None:
            return Text("waiting for the first step…", style="dim")
        host = v.latest.host if v.latest else None
        lines: list[RenderableType] = [memory_bar(m, width, host)]
        lines.extend(memory_figures(m, width, v.ooms, host))
        warning = memory_warning(m)
        if warning:
            lines.append(Text(warning, style="bold red"))
        rows = height - len(lines) - 1
        if rows >= 2:
            h = v.series
            series = [Series(h.reserved.values, CACHED, peaks=True)] if len(h.reserved) else []
            series += [Series(h.peak.values, "yellow", peaks=True), Series(h.allocated.values, ALLOCATED, peaks=True)]
            top = m.capacity if m.capacity and m.capacity < 2 * max(h.peak.values or [0]) else None
            lines.extend(plot(series, width, rows, low=0, high=top, label=format_bytes_short))
            lines.append(axis(h.allocated.steps, width))
        return Group(*lines)


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
        n = max(0, min(round(size / capacity * count), count - len(cells)))
        cells += [("█", style)] * n
    cells += [("░", FREE)] * (count - len(cells))
    if m.peak:
        share = m.peak / capacity
        cells[min(count - 1, round(share * count))] = ("┃", "bold red" if share >= WARN_AT else "bold")
    text = Text(no_wrap=True)
    for char, style in cells:
        text.append(char, style=style)
    return text


def memory_figures(m: Memory, width: int, ooms: int, host: HostReading | None = None) -> list[Text]:
    long = width >= 56
    size = format_bytes if long else format_bytes_short
    capacity = f" of {size(m.capacity)}" if m.capacity else ""
    if m.reserved is not None:
        first = Text(no_wrap=True, overflow="ellipsis")
        first.append("■", style=ALLOCATED).append(f" {'allocated' if long else 'alloc'} {size(m.allocated)}  ")
        first.append("■", style=CACHED).append(f" {'reserved' if long else 'resv'} {size(m.reserved)}  ")
        first.append("■", style=FRAGMENTED).append(f" {'fragmented' if long else 'frag'} {size(m.fragmented)}")
        second = Text(f"peak {size(m.peak)}{capacity}", no_wrap=True, overflow="ellipsis")
        second.append(f" · retries {m.alloc_retries or 0}", style="bold red" if m.alloc_retries else "")
        second.append(f" · OOMs {max(ooms, m.ooms or 0)}", style="bold red" if ooms or m.ooms else "")
        lines = [first, second]
        if m.nvml_used is not None or m.nvml_device_used is not None:
            nvml = Text(no_wrap=True, overflow="ellipsis")
            if m.nvml_gap is not None:
                nvml.append("■", style=OTHER).append(
                    f" NVML {size(m.nvml_used)}: +{size(m.nvml_gap)} outside PyTorch"
                    + (" (CUDA context, libraries)" if long else "")
                )
            else:
                nvml.append("■", style=OTHER).append(f" NVML device used {size(m.nvml_device_used)} (all processes)")
            lines.append(nvml)
        return lines
    first = Text(no_wrap=True, overflow="ellipsis")
    second = Text(f"tracked {size(m.allocated)} · peak {size(m.peak)}", no_wrap=True, overflow="ellipsis")
    if m.capacity or host is None or not host.system_total:
        first.append("■", style=ALLOCATED).append(f" params {size(m.params)}  ")
        first.append("■", style=CACHED).append(f" optim {size(m.optimizer)}  ")
        first.append("■", style=OTHER).append(" grads+acts")
        if m.capacity:
            second.append(f" / {size(m.capacity)} budget")
        second.append(f" · RSS {size(m.rss)}", style="dim")
    else:  # the bar is the machine's memory
        first.append("■", style=ALLOCATED).append(f" {'training state' if long else 'state'} {size(m.allocated)}  ")
        first.append("■", style=CACHED).append(f" {'process' if long else 'proc'} {size(host.rss)}  ")
        first.append("■", style=OTHER).append(
            f" {'other processes' if long else 'others'} {size((host.system_used or 0) - (host.rss or 0))}"
        )
        second.append(f" · system {size(host.system_used)} / {size(host.system_total)}")
    second.append(f" · OOMs {ooms}", style="bold red" if ooms else "")
    return [first, second]


def memory_warning(m: Memory) -> str | None:
    if not m.capacity or not m.peak:
        return None
    share = m.peak / m.capacity
    if share < WARN_AT:
        return None
    return f"▲ step peak at {share:.0%} of capacity: b halves the micro-batch, c checkpoints, a mixed precision"


def axis(steps: list[int], width: int, gutter: int = 8) -> Text:
    if not steps:
        return Text("")
    left, right = f"step {steps[0]}", f"{steps[-1]}"
    pad = max(1, width - gutter - len(left) - len(right))
    return Text(" " * gutter + left + " " * pad + right, style="dim", no_wrap=True)


class LossPanel(RunPanel):
    def shows(self) -> Hashable:
        return self.view.generation, self.view.samples_seen

    def render(self) -> RenderableType:
        v = self.view
        width, height = self.content_size.width, self.content_size.height
        if not len(v.series.loss):
            return Text("waiting for the first loss…", style="dim")
        raw = v.series.loss.values
        smoothed = smooth(raw)
        best = min(range(len(raw)), key=raw.__getitem__)
        head = Text(no_wrap=True, overflow="ellipsis")
        latest = v.latest.loss if v.latest and v.latest.loss is not None else raw[-1]
        head.append(f"{latest:.4g}", style="bold")
        head.append(f"  smoothed {smoothed[-1]:.4g}", style="green")
        head.append(f"  min {raw[best]:.4g} @ {v.series.loss.steps[best]}", style="dim")
        if v.latest and v.latest.loss_source:  # an own loop: say where the loss was read
            head.append(f"  from {v.latest.loss_source}", style="italic")
        rows = height - 2
        lines: list[RenderableType] = [head]
        if rows >= 2:
            # The first steps' loss is often far above the rest: the top follows the later 90% of the
            # run, so the part being trained now is not squashed flat (earlier points touch the top).
            high = max(raw[len(raw) // 10 :]) if len(raw) >= 20 else None
            lines.extend(plot([Series(raw, "dim"), Series(smoothed, "bold green")], width, rows, high=high))
            lines.append(axis(v.series.loss.steps, width))
        return Group(*lines)


OWN_LOOP_KEYS = (
    ("f", "free_cache", "free cache"),
    ("s", "snapshot", "snapshot"),
    ("t", "top_tensors", "top tensors"),
    ("p", "toggle_pause", "pause"),
)
"""The own-loop bar's keys: it has no micro-batch, AMP or checkpointing of gputui's to show (a key
the run refuses is dimmed, and says why when pressed)."""


class RemediesBar(RunPanel):
    """The remedies in force, each after its key (dimmed when it cannot act now)."""

    def __init__(self, view: RunView, watch_only: str | None, *, id: str | None = None) -> None:
        super().__init__(view, id=id)
        self.watch_only = watch_only

    def shows(self) -> Hashable:
        v, s = self.view, self.view.latest
        batch = (s.micro_batch, s.accumulation, s.batch_size) if s else None
        dimmed = tuple(v.why_not(k.action, self.watch_only) is not None for k in KEYS if k.control)
        return v.observed, batch, v.amp, v.checkpointing, v.auto_recover, len(v.pending), dimmed

    def render(self) -> RenderableType:
        v = self.view
        s = v.latest
        text = Text(no_wrap=True, overflow="ellipsis")

        def key(k: str, action: str) -> None:
            dim = v.why_not(action, self.watch_only) is not None
            text.append(f"[{k}]", style="dim" if dim else "bold reverse")
            text.append(" ")

        wide = self.content_size.width >= 90
        if v.observed:
            text.append("own loop, observed: ", style="bold")
            for k, action, label in OWN_LOOP_KEYS:
                key(k, action)
                text.append(f"{label}  ")
            text.append("· b a c o need gputui.fit (README: Adopting fit)", style="dim")
            return text
        key("b/B", "halve_batch")
        if s is not None:
            text.append(
                f"{'micro-batch' if wide else 'mb'} {s.micro_batch} × {s.accumulation} = {s.batch_size}", style="bold"
            )
        else:
            text.append("micro-batch –")
        gap = "   " if wide else "  "
        text.append(gap)
        key("a", "cycle_amp")
        text.append(f"AMP {v.amp or '–'}", style="bold")
        text.append(gap)
        key("c", "toggle_checkpointing")
        text.append(f"{'checkpointing' if wide else 'ckpt'} {'on' if v.checkpointing else 'off'}", style="bold")
        text.append(gap)
        key("o", "toggle_auto_recover")
        text.append(f"{'auto-recover' if wide else 'auto'} {'on' if v.auto_recover else 'off'}", style="bold")
        if v.pending:
            text.append(f"{gap}→ {len(v.pending)} pending", style="yellow")
        return text


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
            line.append(time.strftime("%H:%M:%S ", time.localtime(entry.t)), style="dim")
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
