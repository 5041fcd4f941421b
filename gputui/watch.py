"""`gputui watch`: every GPU and its processes, once (as a table or as JSON) or on a live screen.

No torch: watching a GPU must not pay torch's import time or create a CUDA context.
"""

from __future__ import annotations

import json
import socket
import time
from typing import TextIO

from .probes.nvml import MIN_INTERVAL, NvmlPoller, read_gpus
from .telemetry.sample import GpuDevice, GpuProcess
from .units import format_bytes, format_figure


def run_once(as_json: bool, out: TextIO, err: TextIO) -> int:
    """Print one reading to `out`; exit code 1 with `gputui: <why>` on `err` when NVML is unavailable."""
    reading = read_gpus()
    if reading.status is not None:
        print(f"gputui: {reading.status}", file=err)
        return 1
    if as_json:
        json.dump(reading.to_json(), out, indent=2)
        out.write("\n")
        return 0
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(reading.t))
    print(f"{socket.gethostname()}  {stamp}  driver {reading.driver or 'n/a'}", file=out)
    degrees = _degrees(out)
    for device in reading.devices:
        print(device_line(device, degrees), file=out)
    return 0


def run_screen(refresh: float, err: TextIO) -> int:
    """The live screen, `refresh` times a second; exit code 1 with `gputui: <why>` on `err` when NVML is
    unavailable, before the app takes the terminal (a blank screen would only hide the reason)."""
    reading = read_gpus()
    if reading.status is not None:
        print(f"gputui: {reading.status}", file=err)
        return 1
    from .tui.watch_app import WatchApp  # textual only for the screen: --once stays quick to start

    with NvmlPoller(interval=max(MIN_INTERVAL, 1 / refresh)) as poller:
        WatchApp(poller, refresh=refresh).run()
    return 0


def device_line(device: GpuDevice, degrees: str = "°C") -> str:
    """One GPU the way gpustat prints it; "n/a" for every figure NVML did not give."""
    if device.error is not None:
        return f"[{device.index}] error: {device.error}"
    fields = [
        f"[{device.index}] {device.name or 'n/a'}",
        format_figure(device.temperature, degrees),
        format_figure(device.utilization, " %"),
        f"{format_figure(device.power, ' W', '.0f')} / {format_figure(device.power_limit, ' W', '.0f')}",
        f"{format_bytes(device.memory_used)} / {format_bytes(device.memory_total)}",
    ]
    line = " | ".join(fields)
    if device.processes:
        line += " | " + " ".join(_process(p) for p in device.processes)
    return line


def _process(process: GpuProcess) -> str:
    owner = f"{process.user}/{process.pid}" if process.user else str(process.pid)
    return f"{owner}({format_bytes(process.gpu_memory)})"


def _degrees(out: TextIO) -> str:
    """The degree sign where the output can encode it, else a plain C (an ASCII locale, a log file)."""
    try:
        "°".encode(getattr(out, "encoding", None) or "utf-8")
    except (UnicodeEncodeError, LookupError):
        return "C"
    return "°C"
