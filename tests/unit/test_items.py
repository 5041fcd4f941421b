"""Token-weighted micro-batches: with `items`, each piece's loss is weighted by the items it is a mean
over, so the accumulated gradient is the global batch's token mean whatever the padding."""

import dataclasses

import pytest
import torch
from helpers import (
    TokenModel,
    assert_same_weights,
    count_tokens,
    halving_only,
    own_process,
    padded_batches,
    padded_step,
    plain_loop,
    twins,
)

import gputui
from gputui.step.microbatch import token_weighted


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.5)


def fitted_gradients(model, batch, **kwargs):
    """The gradient fit hands to optimizer.step() for one global batch."""
    grads = []

    class Capture(torch.optim.SGD):
        def step(self, closure=None):
            grads.extend(p.grad.clone() for p in model.parameters())
            return super().step(closure)

    result = gputui.fit(model, [batch], padded_step, Capture(model.parameters(), lr=0.0), **kwargs)
    return grads, result


def whole_batch_gradients(batch):
    torch.manual_seed(0)
    model = TokenModel()
    padded_step(model, batch).backward()
    return [p.grad.clone() for p in model.parameters()]


def relative_error(grads, expected):
    num = sum(float((g - e).norm() ** 2) for g, e in zip(grads, expected, strict=True)) ** 0.5
    return num / sum(float(e.norm() ** 2) for e in expected) ** 0.5


@pytest.mark.parametrize("micro_batch", [1, 2, 3])
def test_gradients_at_every_micro_batch_equal_the_whole_batch(micro_batch):
    batch = padded_batches(1, 8)[0]  # micro-batch 3: pieces of 3, 3 and 2 samples
    expected = whole_batch_gradients(batch)
    torch.manual_seed(0)
    grads, result = fitted_gradients(TokenModel(), batch, micro_batch=micro_batch, items=count_tokens)
    for g, e in zip(grads, expected, strict=True):
        torch.testing.assert_close(g, e, atol=1e-6, rtol=1e-5)
    assert result.micro_batch == micro_batch
    assert not [e for e in result.events if e.name == "items_hint"]  # items given: nothing to say


def test_without_items_a_split_batch_is_weighted_by_samples_and_says_so_once(hub):
    """The data discriminates (sample weights are far off here), and the hint names the fix."""
    batches = padded_batches(3, 8)
    expected = whole_batch_gradients(batches[0])
    torch.manual_seed(0)
    grads, _ = fitted_gradients(TokenModel(), batches[0], micro_batch=2)
    assert relative_error(grads, expected) > 0.05
    torch.manual_seed(0)
    model = TokenModel()
    before = hub.last_step()  # the fit above is this process's run so far: the steps count on
    result = gputui.fit(model, batches, padded_step, sgd(model), micro_batch=2)
    hints = [e for e in result.events if e.name == "items_hint"]
    assert len(hints) == 1 and hints[0].step == before
    assert hints[0]["fix"] == 'items=lambda batch: (batch["labels"][:, 1:] != -100).sum()'


def test_oom_replays_keep_the_token_weights(monkeypatch):
    """Halvings forced by a budget replay each batch at smaller pieces: still the plain loop's weights."""
    halving_only(monkeypatch)
    batches = padded_batches(4, 8, seed=2)
    ref, model = twins(TokenModel)
    plain_loop(ref, batches, padded_step, sgd)
    result = gputui.fit(model, batches, padded_step, sgd(model), items=count_tokens, memory_budget="40KiB")
    assert result.ooms_recovered >= 2, "the budget must force halvings for this test to mean anything"
    assert_same_weights(model, ref)


@pytest.mark.parametrize(
    ("empty", "micro_batch"),
    [(slice(0, 2), 2), (slice(2, 4), 2), (slice(3, 4), 1), (slice(3, 4), 3)],
    ids=["first-of-2", "last-of-2", "last-of-4", "last-of-3+1"],
)
def test_a_piece_without_items_is_skipped_wherever_it_is(empty, micro_batch):
    """Its mean over nothing is nan: run at weight 0, it made the loss nan (and a masked mean's gradients)."""
    batch = padded_batches(1, 4)[0]
    batch["labels"][empty] = -100
    expected = whole_batch_gradients(batch)
    torch.manual_seed(0)
    whole_loss = padded_step(TokenModel(), batch).item()
    torch.manual_seed(0)
    grads, result = fitted_gradients(TokenModel(), batch, micro_batch=micro_batch, items=count_tokens)
    for g, e in zip(grads, expected, strict=True):
        torch.testing.assert_close(g, e, atol=1e-6, rtol=1e-5)
    assert result.loss == pytest.approx(whole_loss, rel=1e-5)


@pytest.mark.parametrize("micro_batch", [2, None], ids=["cut", "whole"])
def test_a_batch_without_any_item_is_an_error(micro_batch):
    """Trained whole, its nan loss would have trained into every weight."""
    batch = padded_batches(1, 4)[0]
    batch["labels"][:] = -100
    model = TokenModel()
    before = [p.detach().clone() for p in model.parameters()]
    with own_process(), pytest.raises(gputui.FitError, match="counted 0 items in the whole batch of step 1"):
        gputui.fit(model, [batch], padded_step, sgd(model), micro_batch=micro_batch, items=count_tokens)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))


@pytest.mark.parametrize(
    ("items", "shown"),
    [
        (lambda b: 2.5, "2.5"),
        (lambda b: -1, "-1"),
        (lambda b: "many", "'many'"),
        (lambda b: b["labels"] != -100, "a tensor of shape (2, 7)"),
        (lambda b: True, "True"),
    ],
)
def test_an_items_that_is_no_count_is_one_clear_error(items, shown):
    model = TokenModel()
    with pytest.raises(gputui.FitError) as caught:
        gputui.fit(model, padded_batches(1, 4), padded_step, sgd(model), micro_batch=2, items=items)
    assert str(caught.value) == f"items(batch) must return a count (an int >= 0, or a one-element tensor), got {shown}"


def test_items_must_be_a_function():
    model = TokenModel()
    with pytest.raises(TypeError, match="items must be a function items"):
        gputui.fit(model, padded_batches(1, 4), padded_step, sgd(model), items=3)


@dataclasses.dataclass
class Batch:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor


def test_what_looks_token_weighted():
    labels = torch.tensor([[1, 2, -100]])
    assert token_weighted({"labels": labels})[1] == 'items=lambda batch: (batch["labels"][:, 1:] != -100).sum()'
    assert token_weighted({"labels": labels[0]})[1] == 'items=lambda batch: (batch["labels"] != -100).sum()'
    assert token_weighted({"labels": labels.clamp(min=0)}) is None  # no padding: nothing to say
    masked = Batch(torch.zeros(1, 3), torch.tensor([[1, 1, 0]]))
    assert token_weighted(masked)[1] == "items=lambda batch: batch.attention_mask[:, 1:].sum()"
    assert token_weighted(Batch(torch.zeros(1, 3), torch.ones(1, 3))) is None
    assert token_weighted((torch.zeros(2), labels)) is None  # names nothing: cannot tell
