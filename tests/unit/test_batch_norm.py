"""BatchNorm normalizes over the micro-batch it is given: gputui says so once, never cuts a
micro-batch of 1 sample for it (PyTorch's ValueError mid-step), and stops with a FitError that
says what to do when memory runs out at 2."""

import pytest
import torch
from helpers import (
    RequestAt,
    Sink,
    assert_same_buffers,
    assert_same_tensors,
    assert_same_weights,
    thrashing_allocator,
    twins,
)
from torch import nn
from torch.nn import functional as F

import gputui
from gputui.engine.oom import Buffers
from gputui.step.microbatch import sizes, split
from gputui.telemetry.controls import BATCH_NORM_FLOOR
from gputui.telemetry.describe import describe
from gputui.tui.availability import why_not
from gputui.tui.sources import LocalSource
from gputui.tui.view import RunView

FLOOR_ERROR = "BatchNorm needs at least 2 samples per micro-batch, so it cannot be halved again"


class BnNet(nn.Module):
    """BatchNorm1d on (N, C): in training, a batch of one sample is PyTorch's ValueError. The wide
    layer after it makes each sample's activations (32 KiB) dwarf what comes before the norm."""

    def __init__(self, norm=nn.BatchNorm1d) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.norm = norm(16)
        self.wide = nn.Linear(16, 4096)
        self.out = nn.Linear(4096, 5)

    def forward(self, x):
        return self.out(torch.relu(self.wide(self.norm(self.inp(x)))))


class FrozenBn(BnNet):
    """Detection-style: train() keeps the norm in eval mode, so it uses its running statistics."""

    def train(self, mode=True):
        super().train(mode)
        self.norm.eval()
        return self


class InstanceNet(BnNet):
    """InstanceNorm normalizes each sample on its own: one sample per micro-batch is fine."""

    def __init__(self) -> None:
        super().__init__(lambda c: nn.InstanceNorm1d(c, affine=True, track_running_stats=True))

    def forward(self, x):
        return self.out(torch.relu(self.wide(self.norm(self.inp(x).unsqueeze(-1).expand(-1, -1, 3)).mean(-1))))


def step(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


def batches(n, size, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, 8, generator=g), torch.randint(5, (size,), generator=g)) for _ in range(n)]


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.05)


def params_bytes(model):
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_an_oom_at_micro_batch_2_stops_with_a_fit_error_that_says_what_to_do(hub):
    model = BnNet()
    # the parameters fit, two samples' activations do not: every attempt fails in forward
    budget = params_bytes(model) + 16 * 1024
    with pytest.raises(gputui.FitError, match=FLOOR_ERROR) as info:
        gputui.fit(model, batches(2, 16), step, sgd(model), memory_budget=budget)
    assert "GroupNorm or LayerNorm" in str(info.value) and "\n" not in str(info.value)
    assert info.value.result.steps == 0
    ooms = [(e.name, e["micro_batch"]) for e in hub.events() if e.name.startswith("oom")]
    assert ooms == [("oom_recovered", 16), ("oom_recovered", 8), ("oom_recovered", 4), ("oom", 2)]


def test_halving_a_micro_batch_of_3_gives_2_and_then_is_refused(hub):
    model = BnNet()
    hub.controls.request("halve_batch")
    hub.controls.request("halve_batch")
    result = gputui.fit(model, batches(2, 8), step, sgd(model), micro_batch=3)
    changed = [(e["from"], e["to"], e["accumulation"]) for e in result.events if e.name == "micro_batch_changed"]
    assert changed == [(3, 2, 4)]
    assert [e["reason"] for e in result.events if e.name == "control_refused"] == [BATCH_NORM_FLOOR]
    assert result.steps == 2 and result.micro_batch == 2


def test_thrashing_halves_no_further_than_2(hub, monkeypatch):
    thrashing_allocator(monkeypatch)
    model = BnNet()
    result = gputui.fit(model, batches(14, 8), step, sgd(model))
    thrash = [(e["micro_batch"], e["micro_batch_to"]) for e in result.events if e.name == "thrashing"]
    assert thrash == [(8, 4), (4, 2)]
    assert result.steps == 14 and result.micro_batch == 2


def test_micro_batch_1_with_batch_norm_is_refused_before_training(hub):
    model = BnNet()
    with pytest.raises(ValueError, match=f"micro_batch=1, but the model has BatchNorm layers and {BATCH_NORM_FLOOR}"):
        gputui.fit(model, batches(2, 4), step, sgd(model), micro_batch=1)
    assert hub.info is None  # no run was started


@pytest.mark.parametrize("make", [FrozenBn, InstanceNet], ids=["batch-norm-in-eval", "instance-norm"])
def test_norms_that_do_not_depend_on_the_batch_train_at_micro_batch_1(hub, make):
    model = make()
    result = gputui.fit(model, batches(2, 4), step, sgd(model), micro_batch=1)
    assert result.steps == 2 and hub.info.batch_norm == 0 and hub.info.min_micro_batch == 1
    assert not any(e.name == "batch_norm_micro_batched" for e in result.events)


def test_said_once_when_training_first_goes_micro_batched(hub):
    model = BnNet()
    calls = [0]

    def failing(m, batch):  # the first attempt of step 1 runs out of memory
        calls[0] += 1
        if calls[0] == 1:
            raise torch.OutOfMemoryError("out of memory")
        return step(m, batch)

    hub.add_sink(RequestAt(hub, 2, "halve_batch"))  # a second way to a smaller micro-batch: nothing new to say
    result = gputui.fit(model, batches(4, 8), failing, sgd(model))
    names = [e.name for e in result.events]
    assert names == ["oom_recovered", "batch_norm_micro_batched", "micro_batch_changed"]
    said = result.events[1]
    assert (said.step, said["layers"], said["micro_batch"], said["batch_size"]) == (0, 1, 4, 8)
    assert describe(said).startswith(
        "BatchNorm now normalizes over micro-batches of 4 samples, not the global batch of 8"
    )
    assert result.steps == 4 and result.micro_batch == 2


def test_nothing_said_without_batch_norm_or_without_micro_batching(hub):
    plain = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 5))
    result = gputui.fit(plain, batches(2, 8), step, sgd(plain), micro_batch=2)
    model = BnNet()
    result2 = gputui.fit(model, batches(2, 8), step, sgd(model), micro_batch=8)
    assert not any(e.name == "batch_norm_micro_batched" for e in result.events + result2.events)


def test_sizes_never_leave_a_last_micro_batch_of_1_when_asked_not_to():
    assert sizes(10, 3) == [3, 3, 3, 1]
    assert sizes(10, 3, smallest=2) == [3, 3, 4]
    assert sizes(11, 3, smallest=2) == [3, 3, 3, 2]
    assert sizes(3, 2, smallest=2) == [3] and sizes(1, 2, smallest=2) == [1] and sizes(8, 8, 2) == [8]
    x = torch.arange(10)
    parts = split(x, 3, smallest=2)
    assert [p.tolist() for p in parts] == [[0, 1, 2], [3, 4, 5], [6, 7, 8, 9]]
    assert all(p.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() for p in parts)  # views


def test_a_last_micro_batch_of_1_joins_the_one_before_with_its_share_of_the_loss(hub):
    """Global batch 10 at micro-batch 3: pieces of 3, 3 and 4 (a piece of 1 is PyTorch's ValueError
    in BatchNorm1d), each loss weighted by its size: as a plain loop over the same pieces."""
    data = batches(3, 10, seed=1)
    ref, model = twins(BnNet)
    result = gputui.fit(model, data, step, sgd(model), micro_batch=3)
    assert result.steps == 3 and all(s.accumulation == 3 for s in hub.samples())

    optimizer = sgd(ref)
    for x, y in data:
        for xs, ys in zip(x.split([3, 3, 4]), y.split([3, 3, 4]), strict=True):
            (step(ref, (xs, ys)) * (len(xs) / 10)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    assert_same_weights(model, ref)
    assert_same_buffers(model, ref)


def test_the_halve_key_is_dimmed_at_the_floor_with_the_reason(hub):
    view, source, reasons = RunView(), LocalSource(hub), []

    class Reader(Sink):  # the TUI's view of the run, read while it trains
        def on_sample(self, sample):
            view.apply(source.poll())
            reasons.append(why_not(view, "halve_batch", None))

    hub.add_sink(Reader())
    model = BnNet()
    gputui.fit(model, batches(1, 8), step, sgd(model), micro_batch=4)
    gputui.fit(model, batches(1, 8), step, sgd(model), micro_batch=2)
    assert reasons == [None, BATCH_NORM_FLOOR]


def test_running_statistics_of_a_lazy_batch_norm_are_saved_once_it_has_them():
    """LazyBatchNorm has no buffers before its first forward: nothing to copy until then."""
    model = nn.Sequential(nn.Linear(8, 16), nn.LazyBatchNorm1d()).train()
    buffers = Buffers(model)
    assert buffers.batch_norms == 1
    buffers.save()  # before the first forward: nothing to save yet
    x = torch.randn(4, 8)
    model(x)
    buffers.save()
    before = {name: b.clone() for name, b in model.named_buffers()}
    model(x)
    buffers.restore()
    assert_same_tensors(dict(model.named_buffers()), before, atol=0, rtol=0)
