"""The loss read without waiting for the device (engine/deferred.py), driven on the CPU by copies that
arrive late, as a GPU's would: samples carry the newest loss that arrived, fit returns the last one exactly."""

import gc
import math
import weakref

import pytest
import torch
from helpers import ConvNet, conv_batches, conv_step
from torch.nn import functional as F

import gputui
from gputui.engine import deferred
from gputui.engine.deferred import MAX_PENDING, DeferredLoss


def late(steps: int):
    """A Copy class whose copies arrive `steps` puts after they started (wait() makes one arrive now)."""
    puts = [0]

    class Late:
        made = 0

        def __init__(self) -> None:
            Late.made += 1

        def start(self, loss: torch.Tensor) -> None:
            puts[0] += 1
            self.at, self.loss, self.waited = puts[0], loss.item(), False

        def done(self) -> bool:
            return self.waited or puts[0] >= self.at + steps

        def wait(self) -> None:
            self.waited = True

        def value(self) -> float:
            return self.loss

    return Late


def test_each_loss_is_taken_once_it_arrives_in_order_and_the_last_is_waited_for():
    copies = late(2)
    losses = DeferredLoss(copies)
    seen = [losses.put(torch.tensor(float(i))) for i in range(1, 6)]
    assert seen == [None, None, 1.0, 2.0, 3.0]  # two steps late
    assert losses.poll() == 3.0
    assert losses.last() == 5.0 and losses.latest == 5.0 and losses.last() == 5.0
    assert copies.made == 3  # the ones read are used again


def test_a_device_far_behind_costs_a_bounded_number_of_copies():
    copies = late(10_000)
    losses = DeferredLoss(copies)
    for i in range(3 * MAX_PENDING):
        assert losses.put(torch.tensor(float(i))) is None
    assert copies.made == MAX_PENDING
    assert losses.last() == 3 * MAX_PENDING - 1


def test_each_value_is_handed_on_once_in_step_order_even_those_never_shown():
    """What a value is handed to (the grad norm's check for a skipped fp16 step) sees every value once, in
    order: those read late, those past MAX_PENDING (never shown, waited for then), and the last ones."""
    handed = []
    values = DeferredLoss(late(10_000))
    for i in range(MAX_PENDING + 5):
        values.put(torch.tensor(float(i)), handed.append if i % 2 else None)
    assert handed == [float(i) for i in range(1, 5, 2)]  # the five oldest went: the odd ones among them handed on
    assert values.last() == MAX_PENDING + 4
    assert handed == [float(i) for i in range(1, MAX_PENDING + 5, 2)]
    assert values.last() == MAX_PENDING + 4 and len(handed) == (MAX_PENDING + 4) // 2  # each once
    now = DeferredLoss.for_device(torch.device("cpu"))
    assert now.put(torch.tensor(1.5), handed.append) == 1.5 and handed[-1] == 1.5


def test_without_a_device_to_wait_for_each_loss_is_read_at_once():
    losses = DeferredLoss.for_device(torch.device("cpu"))
    assert losses.put(torch.tensor(2.5)) == 2.5 and losses.last() == 2.5


def test_fit_publishes_the_losses_that_arrived_and_returns_the_last_one_exact(hub, monkeypatch):
    def run(copies):
        torch.manual_seed(0)
        model = ConvNet()
        losses = []

        def step(model, batch):
            loss = conv_step(model, batch)
            losses.append(loss.item())
            return loss

        if copies is not None:
            monkeypatch.setattr(deferred.DeferredLoss, "for_device", classmethod(lambda cls, device: cls(copies)))
        start = len(hub.samples())
        result = gputui.fit(
            model, conv_batches(6, 8), step, torch.optim.SGD(model.parameters(), lr=0.05), clip_grad_norm=math.inf
        )
        samples = hub.samples()[start:]
        return result, [s.loss for s in samples], losses, [s.grad_norm for s in samples]

    now, now_samples, computed, norms = run(None)
    later, later_samples, _, later_norms = run(late(1))
    assert now_samples == computed
    assert later_samples == [None, *computed[:-1]]  # each sample a step late on a device that lags
    assert now.loss == later.loss == computed[-1]  # but the run's last loss is exact
    assert None not in norms and later_norms == [None, *norms[:-1]]  # the gradient norm travels the same way


def test_the_loss_read_does_not_keep_the_steps_graph_alive_through_the_optimizer(hub):
    """The loss handed to the reader is detached: what the step's graph holds beyond its saved tensors (a
    Function's own attributes) goes after backward, before optimizer.step() allocates its state."""
    refs = []

    class Keep(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.big = torch.ones(256, 256)  # an attribute, not save_for_backward: it goes with the graph
            refs.append(weakref.ref(ctx.big))
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            return grad * 2

    alive = []

    class Watching(torch.optim.SGD):
        def step(self, closure=None):
            alive.append(sum(ref() is not None for ref in refs))
            return super().step(closure)

    model = torch.nn.Linear(4, 1)
    batches = [(torch.randn(4, 4), torch.randn(4, 1)) for _ in range(3)]
    gputui.fit(model, batches, lambda m, b: F.mse_loss(Keep.apply(m(b[0])), b[1]), Watching(model.parameters(), 0.1))
    assert alive == [0, 0, 0]


def test_each_parameters_gradient_accumulator_outlives_the_freed_graph_until_fit_returns(hub):
    """The graph goes after backward, but the node each parameter's gradient is accumulated by stays for
    the run (the optimizer step after the free was slower without it), and goes when fit returns."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    found = []

    def step(m, batch):
        weight = m[0].weight
        node = weight.view_as(weight).grad_fn.next_functions[0][0]
        found.append(node.metadata.get("marked", False))
        node.metadata["marked"] = True  # a node made again for this step would not have it
        return F.mse_loss(m(batch[0]), batch[1])

    batches = [(torch.randn(4, 4), torch.randn(4, 1)) for _ in range(3)]
    gputui.fit(model, batches, step, torch.optim.SGD(model.parameters(), lr=0.1))
    assert found == [False, True, True]
    gone = weakref.ref(model[0].weight)
    del model
    gc.collect()
    assert gone() is None  # nothing of the run holds the parameters once fit has returned


@pytest.mark.parametrize(
    "settings",
    [{}, {"memory_budget": "1GiB"}, {"micro_batch": 4}, {"micro_batch": "auto", "memory_budget": "1GiB"}],
    ids=["plain", "budget", "micro-batched", "planned"],
)
def test_fit_leaves_the_model_and_optimizer_to_reference_counting(hub, settings):
    """Once fit returns, the model and optimizer the script drops go at once, their memory with them (on a
    GPU, the optimizer's state): no cycle of the run's parts holds them until a collection finds it."""
    gc.collect()
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    batches = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(3)]
    gputui.fit(model, batches, lambda m, b: F.mse_loss(m(b[0]), b[1]), optimizer, **settings)
    del model, optimizer
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        held = [type(o).__name__ for o in gc.garbage if isinstance(o, (torch.nn.Module, torch.optim.Optimizer))]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert held == []
