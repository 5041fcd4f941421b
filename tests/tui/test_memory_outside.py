"""The memory bar is what this process can have; what lies outside it is said as NVML knows it
(this process's context, other processes), or said to be unknown (a container hides the pid)."""

from dataclasses import replace

from fakes import GiB, MiB, cuda_sample

from gputui.tui.panels.memory import FREE, OTHER, memory_bar, memory_figures
from gputui.tui.screens.memory import memory_report
from gputui.tui.sources import Update
from gputui.tui.view import RunView

# Under an 8 GiB limit on a shared 80 GiB GPU: this process reserved 6 GiB, and NVML sees 70 GiB used.
CAPPED = replace(
    cuda_sample(1).memory,
    allocated=4 * GiB,
    reserved=6 * GiB,
    fragmented=0,
    peak=5 * GiB,
    capacity=8 * GiB,
    nvml_used=6 * GiB + 512 * MiB,
    nvml_device_used=70 * GiB,
)
IN_A_CONTAINER = replace(CAPPED, nvml_used=None)  # NVML lists the host's pids: none is this one


def cells(bar, style):
    return sum(span.end - span.start for span in bar.spans if span.style == style)


def test_other_processes_do_not_fill_the_bar_of_a_capped_process():
    for memory in (CAPPED, IN_A_CONTAINER):
        bar = memory_bar(memory, 80)
        assert cells(bar, OTHER) == 0
        assert cells(bar, FREE) == 20  # the 2 GiB of the 8 this process has not reserved


def text(lines):
    return "\n".join(line.plain for line in lines)


def test_what_nvml_knows_of_this_process_and_the_others_is_said():
    shown = text(memory_figures(CAPPED, 100, ooms=0))
    assert "NVML 6.50 GiB: +512 MiB outside PyTorch (CUDA context, libraries)" in shown
    assert "other processes 63.5 GiB" in shown


def test_in_a_container_the_device_figure_is_named_and_this_process_share_unknown():
    shown = text(memory_figures(IN_A_CONTAINER, 100, ooms=0))
    assert "NVML device used 70.0 GiB" in shown and "this process's share unknown" in shown
    assert "outside PyTorch" not in shown and "other processes" not in shown
    narrow = text(memory_figures(IN_A_CONTAINER, 40, ooms=0))
    assert "own share unknown" in narrow and all(len(line) <= 40 for line in narrow.splitlines())


def report_rows(v):
    """The `m` screen's table as {figure: value}."""
    table = memory_report(v).renderables[1]
    return dict(zip(table.columns[0].cells, table.columns[1].cells, strict=True))


def test_the_memory_screen_says_what_is_unknown():
    v = RunView(script="train.py")
    v.apply(Update([replace(cuda_sample(1), memory=IN_A_CONTAINER)], [], None, None, None, 1))
    rows = report_rows(v)
    assert rows["NVML used (this process)"] == "unknown" and "other processes" not in rows
    v.apply(Update([replace(cuda_sample(2), memory=CAPPED)], [], None, None, None, 1))
    rows = report_rows(v)
    assert rows["other processes"] == "63.5 GiB" and rows["NVML used (this process)"] == "6.50 GiB"
