"""The main screen at 80, 120 and 160 columns: what a user needs is on the screen whole at each
width (legends, reasons, the footer's quit), and the wide screen says more. Read from what is drawn,
not from what a panel would render: a panel that is never redrawn shows what it drew last."""

import io
import re
from dataclasses import replace

import pytest
from conftest import until
from fakes import OWN_LOOP, FrozenClock, MiB, cpu_run, cuda_run, cuda_sample, own_loop_run
from rich.console import Console

from gputui.telemetry.sample import RankMemory
from gputui.tui.app import GputuiApp
from gputui.tui.panels.ranks import rank_lines
from gputui.tui.ranks import Ranks
from gputui.tui.screens.memory import memory_report
from gputui.tui.view import RunView

SIZES = [(80, 24), (120, 40), (160, 48)]


def drawn(app) -> list[str]:
    """The screen as the terminal shows it, one string a row."""
    console = Console(width=app.size.width, height=app.size.height, file=io.StringIO(), record=True)
    console.print(app.screen._compositor.render_update(full=True))
    return console.export_text().splitlines()


def region(app, selector) -> str:
    """What a widget of the main screen covers on the screen (its border included)."""
    r = app.main.query_one(selector).region
    return "\n".join(row[r.x : r.right] for row in drawn(app)[r.y : r.bottom])


async def shown(source, size, remote=False):
    app = GputuiApp(source, script="train.py", clock=FrozenClock(), refresh=4)
    app.view.remote = remote  # as `gputui attach` makes it: the header names the job's script and pid
    async with app.run_test(size=size) as pilot:
        await until(pilot, lambda: app.view.samples_seen > 0)
        await until(pilot, lambda: "quit" in drawn(app)[-1])  # under load the footer is drawn a moment later
        await pilot.pause(0.1)
        keys = ("header", "memory", "loss", "remedies") + (("ranks",) if app.view.job_ranks else ())
        return {key: region(app, f"#{key}") for key in keys} | {
            "footer": drawn(app)[-1],
            "screen": "\n".join(drawn(app)),
        }


def assert_whole(screen):
    """No panel cut a line short (Rich's ellipsis), and the footer keeps help and quit."""
    for key in ("memory", "loss", "remedies", "ranks"):
        assert "…" not in screen.get(key, ""), screen[key]
    assert "? help" in screen["footer"] and "q quit" in screen["footer"], screen["footer"]


@pytest.mark.parametrize("size", SIZES)
async def test_cuda_legends_fit(size):
    screen = await shown(cuda_run(), size)
    assert_whole(screen)
    assert "rank" not in screen["header"]  # one process: no rank to name
    memory, loss = screen["memory"], screen["loss"]
    wide = size[0] >= 120
    for label in ("allocated", "reserved", "fragmented") if wide else ("alloc", "resv", "frag"):
        assert f"■ {label}" in memory, memory
    assert "OOMs 1" in memory and "outside PyTorch" in memory
    assert ("(CUDA context, libraries)" in memory) == (size[0] >= 160)  # the wide panel says more
    # the charts say which line is which, in their border titles
    assert f"━ {'reserved' if wide else 'resv'} ━ peak ━ {'allocated' if wide else 'alloc'}" in memory.splitlines()[0]
    assert "loss ━ raw ━ smoothed" in loss.splitlines()[0]
    assert "smoothed 1.497" in loss and "min 1.435 @ 291" in loss


@pytest.mark.parametrize(
    "unreadable, says",
    [
        ({"fragmented": "expandable segments"}, ["fragmented n/a (expandable segments)", "retries 0"]),
        (
            dict.fromkeys(("fragmented", "alloc_retries", "ooms"), "cudaMallocAsync"),
            ["fragmented n/a (cudaMallocAsync)", "retries n/a (cudaMallocAsync)"],
        ),
    ],
)
async def test_figures_an_allocator_does_not_count_read_na_with_why_not_zero(unreadable, says):
    """Expandable segments count no fragmentation, cudaMallocAsync no blocks at all: the job reads
    them as None and says why in its info (RunInfo.unreadable); the panel says n/a, never 0 B."""
    source = cuda_run()
    samples = [replace(s, memory=replace(s.memory, **dict.fromkeys(unreadable))) for s in source.update.samples]
    source.update = update = replace(
        source.update, samples=samples, info=replace(source.update.info, unreadable=unreadable)
    )
    memory = (await shown(source, (120, 40)))["memory"]
    assert all(text in memory for text in says) and "fragmented 0" not in memory, memory
    view = RunView()
    view.apply(update)
    report = io.StringIO()
    Console(file=report, width=160).print(memory_report(view))  # the `m` screen
    assert re.search(rf"fragmented +n/a \({unreadable['fragmented']}\)", report.getvalue()), report.getvalue()


@pytest.mark.parametrize("size", SIZES)
async def test_cpu_budget_figures_fit(size):
    screen = await shown(cpu_run(), size)
    assert_whole(screen)
    memory = screen["memory"]
    assert "■ params" in memory and "■ optim" in memory and "■ grads+acts" in memory
    assert "RSS 351" in memory and "OOMs 1" in memory and "memory ━ peak ━ tracked" in memory
    assert "▲" in memory and "of capacity: b" in memory


@pytest.mark.parametrize("size", SIZES)
async def test_own_loop_legend_and_reason_fit(size):
    screen = await shown(own_loop_run(), size)
    assert_whole(screen)
    memory, remedies = screen["memory"], screen["remedies"]
    assert "■ other processes" in memory if size[0] >= 120 else "■ others" in memory
    assert "system 618" in memory and "OOMs 0" in memory
    assert "own loop, observed:" in remedies and "need gputui.fit (README: Adopting fit)" in remedies
    # short labels where they save a line: at 120 it fits on one, at 160 the reasons take the second
    assert ("[t] top tensors" in remedies) == (size[0] == 80)
    assert len(remedies.splitlines()) == (1 if size[0] == 120 else 2)
    if size[0] >= 160:  # the wide bar names the keys it cannot offer, and why the others are dimmed
        assert "b B a c o (batch, AMP, checkpointing, auto-recover) need gputui.fit" in remedies
        assert "· s: memory snapshots are a CUDA allocator feature" in remedies
    assert "from backward()" in screen["loss"]


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("remote", [False, True], ids=["local", "attached"])
async def test_a_torchrun_rank_says_which_it_is(size, remote):
    rank = cuda_run(rank=1, world_size=2, job="run7@node0:29500", pid=4242, argv=("ddp.py",))
    screen = await shown(rank, size, remote=remote)
    assert_whole(screen)
    header = screen["header"]
    mode = "│ steering " if remote and size[0] >= 120 else ""  # an attached screen's, where there is room
    assert f"│ rank 1 of 2 {mode}│ training" in header and "…" not in header, header  # kept whole, whatever goes first
    assert ("ddp.py · pid 4242" if remote else "train.py") in header, header
    if size[0] == 160 or (size[0] == 120 and not remote):  # beside the device where the line has room for it
        assert "│ H100 80GB HBM3 │ rank 1 of 2 │" in header, header


@pytest.mark.parametrize("size", SIZES)
async def test_every_rank_of_a_small_job_on_one_line_each(size):
    screen = await shown(cuda_run(ranks=2, rank=0, world_size=2), size)
    assert_whole(screen)
    lines = screen["ranks"].splitlines()
    job = "ranks · 2 in the job · 2,000 samples/s in all · mean loss 2.05"
    assert job in lines[0], lines[0]  # the job's speed summed, its loss averaged
    assert len(lines) == 4  # a line a rank in its border: the charts keep the rest
    this, worst = lines[1], lines[2]
    long = size[0] >= 120
    assert "rank 0" in this and ("14.3 GiB / 80.0 GiB  18%" if long else "14.3G / 80.0G  18%") in this, this
    assert this.rstrip(" │").endswith("this") and "worst" not in this
    assert "rank 1" in worst and "19%" in worst and worst.rstrip(" │").endswith("◀ worst")
    assert ("micro-batch 32" if long else "mb 32") in worst
    assert "ranks ·" not in (await shown(cuda_run(), size))["screen"]  # one process: no panel at all


@pytest.mark.parametrize("size", SIZES)
async def test_many_ranks_the_worst_few_and_this_one(size):
    screen = await shown(cuda_run(ranks=64, rank=3, world_size=64), size, remote=True)
    assert_whole(screen)
    lines = screen["ranks"].splitlines()[1:-1]
    shown_ranks = [int(line.split()[2]) for line in lines[:-1]]
    assert 3 in shown_ranks and 19 in shown_ranks  # this one, and the worst (77.3 GiB of 80)
    assert len(lines) == {24: 3, 40: 5, 48: 9}[size[1]]  # as many lines as the height spares
    assert shown_ranks == sorted(shown_ranks)
    worst = lines[shown_ranks.index(19)]
    assert "97%" in worst and "◀ worst" in worst and "this" in lines[shown_ranks.index(3)]
    left = sorted((r for r in cuda_sample(300, 64).ranks if r.rank not in shown_ranks), key=lambda r: -r.peak)
    note = f"+ {len(left)} more ranks not shown, none above {left[0].peak / left[0].capacity:.0%} of capacity"
    assert lines[-1].strip(" │") == note


def test_rank_lines_without_capacities_are_bars_of_the_highest_peak():
    ranks = Ranks((RankMemory(0, 8, 2 * MiB), RankMemory(1, 4, 4 * MiB), RankMemory(2, 8)), worst=1, this=2)
    lines = [line.plain for line in rank_lines(ranks, 60)]
    assert {len(line) for line in lines} == {60}  # aligned columns, the width filled
    bars = [line.count("█") for line in lines]
    assert bars[1] // 2 <= bars[0] <= (bars[1] + 1) // 2 and bars[2] == 0 and "░" not in lines[1]  # half, full
    assert "peak 2.00M" in lines[0] and "peak 4.00M" in lines[1] and "peak –" in lines[2]
    assert lines[1].rstrip().endswith("mb 4  ◀ worst") and lines[2].rstrip().endswith("this")


async def test_the_footer_drops_the_remedy_keys_first_then_the_dimmed_ones():
    screen = await shown(cuda_run(), (80, 24))
    footer = screen["footer"]
    assert "b halve" not in footer and "o auto" not in footer  # the remedies bar shows them with their keys
    for key in ("f free", "w plan", "p pause", "t tensors", "m memory", "l log", "? help", "q quit"):
        assert key in footer, footer  # w, the planner, is nowhere else on the screen
    cpu = (await shown(cpu_run(), (80, 24)))["footer"]
    assert "s snap" not in cpu and "w plan" in cpu and "^p palette" in cpu, cpu  # a CPU cannot snapshot
    wide = await shown(cuda_run(), (160, 48))
    assert " b halve  B double " in wide["footer"]  # room for all, not compacted


async def test_a_real_own_loop_at_each_width(own_loop_app, hub):
    app = own_loop_app(OWN_LOOP)
    async with app.run_test(size=SIZES[0]) as pilot:
        await until(pilot, lambda: app.view.latest is not None and app.view.latest.step >= 3)
        for size in SIZES:
            await pilot.resize_terminal(*size)
            await pilot.pause(0.3)
            screen = {key: region(app, f"#{key}") for key in ("memory", "loss", "remedies")}
            screen["footer"] = drawn(app)[-1]
            assert_whole(screen)
            assert "need gputui.fit (README: Adopting fit)" in screen["remedies"]
            assert "others" in screen["memory"] or "other processes" in screen["memory"], screen["memory"]
            assert "loss ━ raw ━ smoothed" in screen["loss"] and "from backward()" in screen["loss"]
