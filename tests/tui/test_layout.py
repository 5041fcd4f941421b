"""The main screen at 80, 120 and 160 columns: what a user needs is on the screen whole at each
width (legends, reasons, the footer's quit), and the wide screen says more. Read from what is drawn,
not from what a panel would render: a panel that is never redrawn shows what it drew last."""

import io

import pytest
from conftest import until
from fakes import FrozenClock, cpu_run, cuda_run, own_loop_run
from rich.console import Console

from gputui.tui.app import GputuiApp

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
        return {key: region(app, f"#{key}") for key in ("header", "memory", "loss", "remedies")} | {
            "footer": drawn(app)[-1]
        }


def assert_whole(screen):
    """No panel cut a line short (Rich's ellipsis), and the footer keeps help and quit."""
    for key in ("memory", "loss", "remedies"):
        assert "…" not in screen[key], screen[key]
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
    assert "│ rank 1 of 2 │ training" in header and "…" not in header, header  # kept whole, whatever goes first
    assert ("ddp.py · pid 4242" if remote else "train.py") in header, header
    if size[0] == 160 or (size[0] == 120 and not remote):  # beside the device where the line has room for it
        assert "│ H100 80GB HBM3 │ rank 1 of 2 │" in header, header


async def test_the_footer_drops_the_remedy_keys_first():
    screen = await shown(cuda_run(), (80, 24))
    footer = screen["footer"]
    assert "b halve" not in footer and "o auto" not in footer  # the remedies bar shows them with their keys
    for key in ("f free", "p pause", "t tensors", "m memory", "l log", "? help", "q quit", "^p palette"):
        assert key in footer, footer
    wide = await shown(cuda_run(), (160, 48))
    assert " b halve  B double " in wide["footer"]  # room for all, not compacted


OWN_LOOP = """
import time, torch
from torch import nn
model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(3000):
    x, y = torch.randn(16, 8), torch.randint(2, (16,))
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad(); loss.backward(); opt.step()
    print(f"step {step} loss: {loss.item():.4f}")
    time.sleep(0.01)
"""


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
