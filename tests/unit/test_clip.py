"""Gradient clipping (fit's clip_grad_norm): after the last backward of the global batch, before
optimizer.step(), so micro-batched training (token-weighted, replayed after OOMs) clips as a plain
full-batch loop with torch.nn.utils.clip_grad_norm_ does; the norm before clipping is in every step
record; an fp16 step the GradScaler skips is counted and said."""

import json
import math

import pytest
import torch
from helpers import (
    Tiny,
    TokenModel,
    assert_same_weights,
    count_tokens,
    fp16_clipped_loop,
    halving_only,
    overflowing,
    padded_batches,
    padded_step,
    token_batches,
    token_step,
    twins,
)

import gputui
from gputui.telemetry.describe import describe

LR = 0.5


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=LR)  # SGD: a clipped gradient moves the weights less


def clipped_loop(model, batches, step, clip):
    """The reference: one backward of the whole batch, clip_grad_norm_, one step; the norms it returned."""
    optimizer = sgd(model)
    norms = []
    for batch in batches:
        step(model, batch).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return norms


def published_norms(hub):
    return [s.grad_norm for s in hub.samples()]


def assert_clipped_as_the_plain_loop(hub, batches, step, clip, **options):
    ref, model = twins(TokenModel)
    expected = clipped_loop(ref, batches, step, clip)
    assert sum(n > clip for n in expected) >= 2, "the clip must bite for this test to mean anything"
    result = gputui.fit(model, batches, step, sgd(model), clip_grad_norm=clip, **options)
    assert result.steps == len(batches)
    assert published_norms(hub) == pytest.approx(expected, rel=1e-5)
    assert_same_weights(model, ref)
    return result


def test_micro_batches_are_clipped_as_the_whole_batch(hub):
    assert_clipped_as_the_plain_loop(hub, token_batches(4, 8), token_step, 0.3, micro_batch=2)


def test_token_weighted_micro_batches_are_clipped_as_the_whole_batch(hub):
    """Padded variable-length sequences, weighted by their tokens (items=): the global token mean's norm."""
    assert_clipped_as_the_plain_loop(hub, padded_batches(4, 8), padded_step, 0.5, micro_batch=2, items=count_tokens)


def test_ooms_replay_the_step_and_clip_it_once(hub, monkeypatch):
    """A budget forces halvings mid-step: the replayed steps clip the whole batch's gradient, once."""
    halving_only(monkeypatch)
    batches = padded_batches(4, 8, seed=2)
    result = assert_clipped_as_the_plain_loop(
        hub, batches, padded_step, 0.45, items=count_tokens, memory_budget="40KiB"
    )
    assert result.ooms_recovered >= 2, "the budget must force halvings for this test to mean anything"
    assert [s.step for s in hub.samples()] == [1, 2, 3, 4]  # a record (and a norm) a trained step


def test_an_infinite_clip_measures_the_norm_and_keeps_the_gradient(hub, tmp_path):
    """clip_grad_norm=inf: the plain loop's weights; each step's norm in the metrics file too."""
    batches = token_batches(3, 8)
    ref, model = twins(TokenModel)
    expected = []
    optimizer = sgd(ref)
    for batch in batches:
        token_step(ref, batch).backward()
        expected.append(float(torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()])))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    path = tmp_path / "metrics.jsonl"
    gputui.fit(model, batches, token_step, sgd(model), micro_batch=4, metrics=path, clip_grad_norm=math.inf)
    assert_same_weights(model, ref)
    steps = [r for r in map(json.loads, path.read_text().splitlines()) if r["kind"] == "step"]
    assert [r["grad_norm"] for r in steps] == pytest.approx(expected, rel=1e-5)
    assert published_norms(hub) == pytest.approx(expected, rel=1e-5)


def test_without_a_clip_no_norm_is_measured(hub):
    """The default run pays no read of every gradient: no norm in its records."""
    model = TokenModel()
    gputui.fit(model, token_batches(2, 8), token_step, sgd(model))
    assert [s.grad_norm for s in hub.samples()] == [None, None]


@pytest.mark.parametrize("clip", [0, -1.0, math.nan, -math.inf, True, "1.0"])
def test_a_clip_that_is_no_positive_number_is_one_clear_error(clip):
    model = TokenModel()
    with pytest.raises(ValueError, match=r"^clip_grad_norm must be a positive number .* or None, got "):
        gputui.fit(model, token_batches(1, 2), token_step, sgd(model), clip_grad_norm=clip)


def test_an_fp16_step_the_grad_scaler_skips_is_counted_said_and_leaves_the_weights(hub):
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)) for _ in range(4)]
    ref, model = twins(Tiny)
    expected = fp16_clipped_loop(ref, batches, overflowing(2), sgd(ref), 0.5)
    assert [math.isfinite(n) for n in expected] == [True, False, True, True], "step 2 alone is skipped"

    result = gputui.fit(model, batches, overflowing(2), sgd(model), amp="fp16", clip_grad_norm=0.5)
    assert result.steps == 4
    assert_same_weights(model, ref)
    norms = published_norms(hub)
    assert not math.isfinite(norms[1])
    assert [norms[0], *norms[2:]] == pytest.approx([expected[0], *expected[2:]], rel=1e-5)
    skipped = [e for e in result.events if e.name == "step_skipped"]
    assert [(e["at"], e["skipped"]) for e in skipped] == [(2, 1)]
    assert describe(skipped[0]).startswith("step 2 skipped: an inf or nan gradient")


@pytest.mark.parametrize(
    "options", [{"micro_batch": 2}, {"memory_budget": "40KiB"}], ids=["micro-batch 2", "budget forcing OOMs"]
)
def test_an_own_loop_on_a_trainer_clips_as_the_plain_loop_with_its_losses_and_norms(monkeypatch, options):
    """gputui.Trainer, token-weighted (items=), micro-batched or halved by OOMs: each StepResult's loss and
    gradient norm, and the weights, are the plain full-batch loop's with clip_grad_norm_."""
    halving_only(monkeypatch)
    batches = padded_batches(4, 8, seed=2)
    ref, model = twins(TokenModel)
    optimizer = sgd(ref)
    losses, norms = [], []
    for batch in batches:
        loss = padded_step(ref, batch)
        loss.backward()
        losses.append(loss.item())
        norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.45)))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    assert sum(n > 0.45 for n in norms) >= 2, "the clip must bite for this test to mean anything"
    with gputui.Trainer(model, sgd(model), padded_step, items=count_tokens, clip_grad_norm=0.45, **options) as t:
        results = [t.step(batch) for batch in batches]
    if "memory_budget" in options:
        assert sum(r.ooms_recovered for r in results) >= 1, "the budget must force an OOM to mean anything"
    assert [r.loss for r in results] == pytest.approx(losses, rel=1e-5)
    assert [r.grad_norm for r in results] == pytest.approx(norms, rel=1e-5)
    assert_same_weights(model, ref)
