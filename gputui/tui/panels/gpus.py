"""NVML's view of the GPUs, one line (the main screen's, and each row of `gputui watch`)."""

from __future__ import annotations

from collections.abc import Hashable

from rich.console import RenderableType
from rich.text import Text

from ...telemetry.sample import GpuDevice
from ...units import format_bytes_short, format_figure
from .base import RunPanel


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
