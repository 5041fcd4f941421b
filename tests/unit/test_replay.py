"""A replayed batch trains exactly as if its failed attempt never happened: the generators a step
draws from (torch's, Python's `random`, NumPy's global one) and the running statistics of its
BatchNorm layers are put back, so weights and buffers equal those of a plain loop without OOM."""

import random

import numpy as np
import pytest
import torch
from helpers import (
    ConvNet,
    assert_same_buffers,
    assert_same_weights,
    conv_batches,
    halving_only,
    micro_batches_used,
    plain_accumulating_loop,
    twins,
)
from torch.nn import functional as F

import gputui


def indexed(batches):
    """Each batch carries its step's number (a third tensor), so a step() knows which step it is in."""
    return [(x, y, torch.full((len(x),), i + 1)) for i, (x, y) in enumerate(batches)]


def noisy_step(draw, first: int):
    """A step() that, from step `first` on, scales its loss by what it draws from a host generator."""

    def step(model, batch):
        x, y, index = batch
        loss = F.cross_entropy(model(x), y)
        if int(index[0]) >= first:
            loss = loss * draw()
        return loss

    return step


def oom_on(step, calls):
    """`step`, raising an OOM on the given calls, after it has drawn (the draws must be replayed)."""
    count = [0]

    def failing(model, batch):
        loss = step(model, batch)
        count[0] += 1
        if count[0] in calls:
            raise torch.OutOfMemoryError("out of memory")
        return loss

    return failing


def draw_python():
    # gauss() keeps a second value for its next call: a step may use it without drawing anew
    return 1 + 0.1 * random.gauss(0, 1) + 0.01 * random.randint(0, 9) + 0.01 * random.random()


def draw_numpy():
    return float(1 + 0.1 * np.random.randn() + 0.01 * np.random.randint(0, 9) + 0.01 * np.random.rand())


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.05)


@pytest.mark.parametrize(
    "draw, seed", [(draw_python, random.seed), (draw_numpy, np.random.seed)], ids=["python", "numpy"]
)
def test_a_script_drawing_from_step_10_on_replays_the_same_draws(draw, seed):
    """Steps 1-9 never draw, so nothing saw the generator in use before the OOM at step 10."""
    batches = indexed(conv_batches(14, 8))
    ref, model = twins(ConvNet)
    step = noisy_step(draw, first=10)
    # calls 1-9: steps 1-9 whole; 10 fails step 10 at 8, then 11 its first half at 4 (12 its second);
    # 14 fails step 11's second half
    failing = oom_on(step, {10, 14})
    seed(3)
    result = gputui.fit(model, batches, failing, sgd(model))
    assert result.ooms_recovered == 2 and (result.steps, result.samples) == (14, 112)

    seed(3)
    plain_accumulating_loop(ref, batches, step, sgd(ref), micro_batches_used(result, 8))
    assert_same_weights(model, ref, atol=0, rtol=0)
    assert type(random._inst) is random.Random and type(np.random) is type(np)  # fit left no trap behind


def test_batch_norm_statistics_do_not_advance_twice_for_a_replayed_batch(monkeypatch):
    """The budget forces OOMs in forward and backward, after BatchNorm layers updated their statistics."""
    halving_only(monkeypatch)
    batches = conv_batches(6, 16, seed=3)
    ref, model = twins(lambda: ConvNet(channels=16, batch_norm=True))
    result = gputui.fit(model, batches, lambda m, b: F.cross_entropy(m(b[0]), b[1]), sgd(model), memory_budget="200KiB")
    assert result.ooms_recovered >= 2, "the budget must force halvings for this test to mean anything"
    assert {e["phase"] for e in result.events if e.name == "oom_recovered"} == {"forward", "backward"}
    assert (result.steps, result.samples) == (6, 96)

    plain_accumulating_loop(
        ref, batches, lambda m, b: F.cross_entropy(m(b[0]), b[1]), sgd(ref), micro_batches_used(result, 16)
    )
    assert_same_weights(model, ref, atol=0, rtol=0)
    assert_same_buffers(model, ref)  # running_mean, running_var, num_batches_tracked
