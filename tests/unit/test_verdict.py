"""The marker on DDP's last bucket (engine/strategies/verdict.py), through the comm hook in a one-rank
gloo group: the bucket is reduced in place (no bucket-sized copy), a rank with news marks its first
element NaN and every rank hears it from the reduced bucket, the element's share is kept to be put
back, and the bucket's wait is the rank's own (a stop there ends it, the error kept for the step)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from gputui.engine.result import FitError
from gputui.engine.strategies.verdict import Marker, with_marker


class Bucket:
    def __init__(self, buffer: torch.Tensor, last: bool = True) -> None:
        self._buffer, self._last = buffer, last
        self.param = torch.nn.Parameter(torch.zeros(2))

    def is_last(self) -> bool:
        return self._last

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def parameters(self) -> list[torch.Tensor]:
        return [self.param]


@pytest.fixture
def group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_news_marks_the_last_bucket_and_every_rank_hears_it(group, dtype):
    m = Marker(1)
    buffer = torch.full((8,), 3.0, dtype=dtype)
    bucket = Bucket(buffer)
    out = with_marker(m, bucket).wait()
    assert out.data_ptr() == buffer.data_ptr() and out.tolist() == [3.0] * 8  # the mean over one rank, in place
    assert (m.sent, m.heard, m.value, m.param is bucket.param) == (True, False, 3.0, True)
    m.clear()
    m.news = True
    out = with_marker(m, Bucket(buffer)).wait()
    assert m.heard and math.isnan(out[0].item()) and out[1:].tolist() == [3.0] * 7
    assert m.value == 3.0  # its share, before the mark: what the exchange puts back


def test_a_bucket_before_the_last_is_neither_marked_nor_waited_for_here(group):
    m = Marker(1)
    m.news = True
    m.wait = lambda work: pytest.fail("waited for a bucket before the last")
    out = with_marker(m, Bucket(torch.ones(4), last=False)).wait()
    assert out.tolist() == [1.0] * 4 and not m.sent and not m.heard


def test_a_stop_in_the_buckets_wait_is_kept_and_raised(group):
    m = Marker(1)
    stop = FitError("rank 0 stopped (interrupted) while waiting for rank 1")

    def wait(work):
        work.wait()
        raise stop

    m.wait = wait
    with pytest.raises(FitError):
        with_marker(m, Bucket(torch.ones(4)))
    assert m.error is stop
