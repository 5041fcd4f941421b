"""gputui.fit must train exactly like a plain PyTorch loop over the same global batches."""

import pytest
import torch
from helpers import (
    ConvNet,
    Residual,
    TokenModel,
    assert_same_weights,
    conv_batches,
    conv_step,
    halving_only,
    plain_loop,
    token_batches,
    token_step,
    twins,
)

import gputui


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def adam(model):
    return torch.optim.Adam(model.parameters(), lr=1e-2)


@pytest.mark.parametrize("micro_batch", [None, 4, 3, 1])
def test_micro_batching_matches_plain_loop(micro_batch):
    batches = conv_batches(5, 12, last=7)  # an uneven last batch too
    ref, model = twins(ConvNet)
    plain_loop(ref, batches, conv_step, sgd)
    result = gputui.fit(model, batches, conv_step, sgd(model), micro_batch=micro_batch)
    assert_same_weights(model, ref)
    assert (result.steps, result.samples) == (5, 4 * 12 + 7)


def test_epochs_over_a_shuffled_data_loader_match_the_plain_loop_and_leave_the_same_generator():
    """A DataLoader draws its shuffle's seed from torch's generator each time it is iterated: fit must
    iterate it exactly as often as a plain loop (once an epoch), or every epoch's order and every draw
    after it differ."""
    x, y = conv_batches(1, 40)[0]

    def loader():
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8, shuffle=True)

    ref, model = twins(ConvNet)
    torch.manual_seed(1)
    plain_loop(ref, loader(), conv_step, sgd, epochs=2)
    plain_next = torch.rand(3)
    torch.manual_seed(1)
    gputui.fit(model, loader(), conv_step, sgd(model), epochs=2)
    assert_same_weights(model, ref, atol=0, rtol=0)
    assert torch.equal(torch.rand(3), plain_next)


@pytest.mark.parametrize("budget", [None, "64MiB"])
def test_a_lazy_module_whose_optimizer_was_made_before_its_first_forward_trains_as_the_plain_loop(budget):
    def lazy():
        return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.LazyLinear(16), torch.nn.ReLU(), torch.nn.LazyLinear(5))

    batches = conv_batches(4, 8)
    ref, model = twins(lazy)
    torch.manual_seed(1)  # the parameters are made (drawn) in the first forward
    plain_loop(ref, batches, conv_step, sgd)
    torch.manual_seed(1)
    result = gputui.fit(model, batches, conv_step, sgd(model), memory_budget=budget, micro_batch=4)
    assert_same_weights(model, ref)
    assert result.steps == 4


def test_one_step_gradient_equals_whole_batch_gradient():
    batch = conv_batches(1, 10)
    ref, model = twins(ConvNet)
    conv_step(ref, batch[0]).backward()
    expected = [p.grad.clone() for p in ref.parameters()]
    grads = []

    class Capture(torch.optim.SGD):
        def step(self, closure=None):
            grads.extend(p.grad.clone() for p in model.parameters())
            return super().step(closure)

    gputui.fit(model, batch, conv_step, Capture(model.parameters(), lr=0.0), micro_batch=3)
    for g, e in zip(grads, expected, strict=True):
        torch.testing.assert_close(g, e, atol=1e-6, rtol=1e-5)


def test_dict_batches_with_adam_and_scheduler_over_epochs():
    batches = token_batches(4, 9)
    ref, model = twins(TokenModel)

    def schedule(opt):
        return torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)

    plain_loop(ref, batches, token_step, adam, epochs=2, scheduler=schedule)
    opt = adam(model)
    sched = schedule(opt)
    result = gputui.fit(model, batches, token_step, opt, epochs=2, micro_batch=4, scheduler=sched)
    assert_same_weights(model, ref)
    assert (result.steps, result.epochs, result.samples) == (8, 2, 72)
    assert sched.last_epoch == 8


def test_forced_oom_halvings_under_budget_match_plain_loop(monkeypatch):
    halving_only(monkeypatch)
    batches = conv_batches(6, 16, seed=3)
    ref, model = twins(lambda: ConvNet(channels=16))
    plain_loop(ref, batches, conv_step, adam)
    result = gputui.fit(model, batches, conv_step, adam(model), memory_budget="200KiB")
    assert result.ooms_recovered >= 3, "the budget must force halvings for this test to mean anything"
    assert {e["phase"] for e in result.events if e.name == "oom_recovered"} == {"forward", "backward"}
    assert result.micro_batch < 16
    assert (result.steps, result.samples) == (6, 96)
    assert_same_weights(model, ref)


def test_checkpointing_matches_plain_loop(monkeypatch):
    batches = conv_batches(4, 8, seed=5)
    ref, model = twins(ConvNet)
    plain_loop(ref, batches, conv_step, adam)
    runs = []
    forward = Residual.forward
    monkeypatch.setattr(Residual, "forward", lambda block, x: runs.append(block) or forward(block, x))
    result = gputui.fit(model, batches, conv_step, adam(model), checkpointing=True, micro_batch=3)
    assert result.checkpointing
    micro_batches = 4 * 3  # 8 samples a batch in micro-batches of 3, 3 and 2
    assert len(runs) == 2 * micro_batches * len(model.body), "each block's forward runs again in backward"
    assert_same_weights(model, ref)
    assert not any("forward" in vars(m) for m in model.modules()), "the wrappers must be removed after fit"


def test_max_steps_runs_as_many_epochs_as_needed():
    batches = conv_batches(3, 4)
    model = ConvNet()
    result = gputui.fit(model, batches, conv_step, sgd(model), max_steps=7)
    assert (result.steps, result.epochs, result.samples) == (7, 2, 28)
    result = gputui.fit(model, batches, conv_step, sgd(model), max_steps=6)
    assert (result.steps, result.epochs) == (6, 2)
    result = gputui.fit(model, batches, conv_step, sgd(model), epochs=1, max_steps=10)
    assert (result.steps, result.epochs) == (3, 1)
