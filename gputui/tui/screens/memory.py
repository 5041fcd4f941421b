"""The memory readings in full: what each figure is and where it comes from."""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.widgets import Footer, Static

from ...units import format_bytes, format_figure
from ..view import RunView
from .base import Overlay


class MemoryScreen(Overlay):
    BINDINGS = [*Overlay.BINDINGS, Binding("m", "dismiss", "back", show=False)]

    def __init__(self, view: RunView) -> None:
        super().__init__()
        self.view = view
        self._shown: tuple[int, int, int, str | None] | None = None  # what the report on screen was made of

    def compose(self) -> ComposeResult:
        yield VerticalScroll(Static(id="memory-text"))
        yield Footer()

    def update(self) -> None:
        v = self.view
        key = (v.generation, v.samples_seen, v.ooms, v.cuda_summary)
        if self.is_mounted and key != self._shown:
            self._shown = key
            self.query_one("#memory-text", Static).update(memory_report(v))


def memory_report(v: RunView) -> Group:
    """Every reading of the latest step with what it means, then torch's own summary (CUDA)."""
    s = v.latest
    if s is None:
        return Group(Text("No step yet.", style="dim"))
    m = s.memory
    hidden = m.nvml_used is None and m.nvml_device_used is not None  # NVML names no memory for this pid
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold", no_wrap=True)
    table.add_column(justify="right", no_wrap=True)
    table.add_column(style="dim")
    rows = [
        (
            "allocated",
            m.allocated,
            "live tensors"
            if m.reserved is not None
            else "tracked training state: parameters + gradients + optimizer state + saved activations",
        ),
        ("reserved", m.reserved, "segments PyTorch's caching allocator holds (allocated + cached free)"),
        ("cached free", m.cached_free, "reserved but holding no tensor: reused before asking the device"),
        ("fragmented", m.fragmented, "inactive split blocks: free pieces of segments still partly in use"),
        ("active", m.active, "allocated + blocks freed but not yet reusable (pending stream work)"),
        ("step peak", m.peak, "the most allocated during the last step"),
        (
            "capacity",
            m.capacity,
            "what this process can have: device free + reserved (CUDA), at most --gpu-memory-limit; the CPU budget",
        ),
        ("device free", m.device_free, "cudaMemGetInfo: free on the whole device, other processes included"),
        (
            "NVML used (this process)",
            "unknown" if hidden else m.nvml_used,
            "NVML lists no memory for this pid (in a container it sees the host's pids): what lies outside "
            "PyTorch and the other processes' share are unknown"
            if hidden
            else "what the driver charges this process",
        ),
        ("NVML - reserved", m.nvml_gap, "CUDA context, cuBLAS/cuDNN/NCCL workspaces: outside PyTorch"),
        ("other processes", m.nvml_others, "NVML used (device) - NVML used (this process)"),
        ("NVML used (device)", m.nvml_device_used, "every process on the device, this one included"),
        ("parameters", m.params, "CPU tracking"),
        ("gradients", m.grads, "CPU tracking (freed after each optimizer step)"),
        ("optimizer state", m.optimizer, "CPU tracking (appears at the first step)"),
        ("saved activations", m.activations, "CPU tracking (freed by backward)"),
        ("RSS", m.rss, "this process's resident memory (host)"),
    ]
    unread = v.info.unreadable if v.info is not None else {}
    for name, value, meaning in rows:
        if name in unread:  # the allocator in use reads it as 0 without counting it
            table.add_row(name, f"n/a ({unread[name]})", f"{meaning}: not counted by this allocator")
        elif value is not None:
            table.add_row(name, value if isinstance(value, str) else format_bytes(value), meaning)
    table.add_row(
        "alloc retries",
        f"n/a ({unread['alloc_retries']})" if "alloc_retries" in unread else format_figure(m.alloc_retries, ""),
        "the allocator freed its cache to satisfy a request: slow, a warning sign",
    )
    table.add_row("OOMs", str(v.ooms), "seen in this run (recovered or not)")
    if s.host is not None:
        h = s.host
        table.add_row("system memory", f"{format_bytes(h.system_used)} / {format_bytes(h.system_total)}", "host")
        table.add_row("CPU", format_figure(h.cpu_percent, " %", ".0f"), "this process, 100% = one core")
    parts: list[RenderableType] = [Text(f"Memory at step {s.step} on {m.device}", style="bold underline"), table]
    if v.cuda_summary:
        parts += [Text(""), Text("torch.cuda.memory_summary()", style="bold underline"), Text(v.cuda_summary)]
    return Group(*parts)
