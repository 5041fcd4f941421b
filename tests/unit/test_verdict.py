"""The synced backward's verdict on DDP's last bucket (engine/strategies/verdict.py), through the
comm hook in a one-rank gloo group: the bucket is reduced in place (no bucket-sized copy to append
the verdict), the verdict's buffer is made once, and a rank's bit never overflows a half-precision
bucket (fp16's 1 << 16 is inf): the ranks it cannot name are left out, the failure still counted."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from gputui.engine.strategies.verdict import Verdict, rank_bits, with_verdict


class Bucket:
    def __init__(self, buffer: torch.Tensor) -> None:
        self._buffer = buffer

    def is_last(self) -> bool:
        return True

    def buffer(self) -> torch.Tensor:
        return self._buffer


@pytest.fixture
def group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def hooked(v: Verdict, buffer: torch.Tensor) -> torch.Tensor:
    return with_verdict(v, Bucket(buffer)).wait()


@pytest.mark.parametrize("dtype, bits", [(torch.float16, 11), (torch.bfloat16, 8), (torch.float32, 24)])
def test_a_rank_past_what_the_dtype_holds_is_not_named_but_counted(group, dtype, bits):
    assert rank_bits(dtype) == bits
    v = Verdict(1)
    for rank, named in ((bits - 1, [bits - 1]), (bits, []), (20, [] if bits <= 20 else [20])):
        v.clear()
        v.mine = [1, 1, 1 << rank]
        hooked(v, torch.ones(4, dtype=dtype))
        assert v.summed is not None and torch.isfinite(v.summed).all(), (dtype, rank)
        failures, fatals, mask = (round(x) for x in v.summed.tolist())
        assert (failures, fatals) == (1, 1)
        assert [r for r in range(min(64, v.bits)) if mask >> r & 1] == named, (dtype, rank)


def test_the_bucket_is_reduced_in_place_and_the_verdict_buffer_made_once(group):
    v = Verdict(1)
    buffer = torch.full((1000,), 2.0, dtype=torch.float16)
    out = hooked(v, buffer)
    assert out.data_ptr() == buffer.data_ptr() and out.tolist() == [2.0] * 1000  # the mean over one rank
    first = v.summed
    assert first is not None and first.tolist() == [0, 0, 0]
    v.clear()
    hooked(v, buffer)
    assert v.summed is first  # the same buffer, zeroed: nothing made or copied a step
