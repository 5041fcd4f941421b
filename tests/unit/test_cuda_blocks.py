"""The planner counts a storage as the CUDA caching allocator does (plan/blocks.py): cases worked by hand
from c10/cuda/CUDACachingAllocator.cpp's round_size, get_allocation_size and should_split, and a trace on
the CPU counted as on CUDA."""

import pytest
import torch
from torch import nn

from gputui.plan import blocks, predict
from gputui.plan.blocks import CudaBlocks

KiB, MiB = 2**10, 2**20


@pytest.mark.parametrize(
    ("asked", "block"),
    [
        (0, 0),  # nothing allocated
        (1, 512),  # below kMinBlockSize
        (512, 512),
        (513, 1024),  # rounded up to 512 B
        (MiB, MiB),  # the largest small request: a 2 MiB segment, split at any 512 B
        (MiB + 1, MiB + 512),  # large: a 20 MiB segment, about 19 MiB would remain: split
        (9 * MiB + 512 * KiB, 9 * MiB + 512 * KiB),  # under kMinLargeAlloc: a 20 MiB segment, split
        (10 * MiB, 10 * MiB),  # a 10 MiB segment, nothing remains
        (10 * MiB + 1, 10 * MiB + 512),  # a 12 MiB segment, 2 MiB - 512 B would remain (> 1 MiB): split
        (11 * MiB - 512, 11 * MiB - 512),  # 1 MiB + 512 B would remain: split
        (11 * MiB, 12 * MiB),  # exactly 1 MiB would remain, not more: the whole segment
        (11 * MiB + 512 * KiB, 12 * MiB),  # 512 KiB would remain: the whole segment
        (101 * MiB + 1, 102 * MiB),  # a 102 MiB segment, 1 MiB - 512 B would remain
    ],
)
def test_a_request_holds_the_block_the_cuda_allocator_gives(asked, block):
    assert CudaBlocks()(asked) == block


def test_expandable_segments_split_every_block_and_max_split_size_splits_none_at_or_above_it():
    assert CudaBlocks(expandable=True)(11 * MiB + 512 * KiB) == 11 * MiB + 512 * KiB
    assert CudaBlocks(expandable=True)(700) == 1024  # still rounded to 512 B
    capped = CudaBlocks(max_split=100 * MiB)
    assert capped(150 * MiB + 1) == 152 * MiB  # at or above max_split_size: never split
    assert capped(50 * MiB + 1) == 50 * MiB + 512  # below it: split as by default


def test_the_settings_in_use_choose_the_rounding(monkeypatch):
    assert blocks.rounding(torch.device("cpu"))(513) == 513  # a CPU counts the bytes asked for
    monkeypatch.setattr(blocks.private, "allocator_settings", lambda: "")
    assert blocks.rounding(torch.device("cuda", 0)) == CudaBlocks()
    settings = "max_split_size_mb:128,expandable_segments:True"
    monkeypatch.setattr(blocks.private, "allocator_settings", lambda: settings)
    assert blocks.rounding(torch.device("cuda", 0)) == CudaBlocks(expandable=True, max_split=128 * MiB)


def test_a_trace_counted_for_cuda_holds_whole_blocks(monkeypatch):
    """An 11.5 MiB weight holds a 12 MiB block on CUDA, and so does its gradient: the trace (on the CPU,
    its counter told to count for CUDA) predicts them so, where the CPU's count is the bytes."""
    torch.manual_seed(0)
    model = nn.Linear(2048, 1472, bias=False)  # 1472 x 2048 x 4 B = 11.5 MiB
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = torch.randn(4, 2048)

    def step(model, x):
        return model(x).pow(2).mean()

    on_cpu = predict(model, opt, batch, step)
    monkeypatch.setattr(blocks, "rounding", lambda device: CudaBlocks())
    on_cuda = predict(model, opt, batch, step)
    assert on_cpu.breakdown["parameters"] == 11 * MiB + 512 * KiB
    assert on_cuda.breakdown["parameters"] == 12 * MiB
    # the peak is in backward, the weight's gradient made (counted among the temporaries until it is
    # accumulated), with the batch (32 KiB) and small tensors
    assert on_cpu.phase == on_cuda.phase == "backward"
    assert on_cpu.peak < 2 * 12 * MiB <= 2 * 12 * MiB + 32 * KiB <= on_cuda.peak < 2 * 12 * MiB + MiB
    assert on_cuda.tracked_peak == on_cpu.tracked_peak  # the CPU tracker's count stays the bytes
