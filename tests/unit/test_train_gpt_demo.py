"""demos/train_gpt.py's helpers: what its resume and its token-weighted micro-batches rely on."""

import sys
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "demos"))
import train_gpt as demo


def test_collate_pads_to_a_multiple_of_8_with_labels_minus_100_on_the_padding():
    batch = demo.collate([b"abc", b"hello world"])
    assert batch["input_ids"].shape == (2, 16)
    assert batch["input_ids"][0, :3].tolist() == list(b"abc") and (batch["input_ids"][0, 3:] == demo.PAD).all()
    assert (batch["labels"][0, 3:] == -100).all() and (batch["labels"][1, :11] == batch["input_ids"][1, :11]).all()


def test_items_counts_exactly_what_the_loss_is_a_mean_over():
    """items must count the shifted labels that count: the loss's sum over tokens is its mean times them
    (an unshifted count, one more a row, would weigh the micro-batches wrong)."""
    torch.manual_seed(0)
    model = demo.GPT(demo.VOCAB, 16, 1, 2, 16)
    batch = demo.collate([b"ab", b"a longer one", b"xyz"])
    with torch.no_grad():
        logits = model(batch["input_ids"])
        total = F.cross_entropy(
            logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(), ignore_index=-100, reduction="sum"
        )
        count = demo.items(batch)
        assert int(count) == 1 + 11 + 2
        assert float(demo.loss_fn(model, batch) * count) == pytest.approx(float(total), rel=1e-6)


def test_lr_warms_up_to_the_peak_then_decays_to_the_floor():
    factors = [demo.lr_factor(s, warmup=10, total=100) for s in range(120)]
    assert factors[0] < factors[5] < factors[9] < 1.0 == factors[10]
    assert all(a >= b for a, b in zip(factors[10:], factors[11:], strict=False))
    assert factors[100] == pytest.approx(0.1) and factors[119] == pytest.approx(0.1)


def test_a_step_batch_is_the_same_whenever_it_is_drawn():
    """A resumed run trains on the batches the stopped run would have: each is drawn from its step."""
    train = [bytes([65 + i % 26]) * (2 + i % 30) for i in range(200)]
    first, again, other = (demo.train_batch(train, 8, step, seed=0) for step in (7, 7, 8))
    assert torch.equal(first["input_ids"], again["input_ids"])
    assert not torch.equal(first["input_ids"], other["input_ids"])


def test_sequences_vary_in_length_and_hold_out_a_tenth():
    train, val = demo.sequences(32)
    assert 0.05 < len(val) / (len(train) + len(val)) < 0.2
    lengths = [len(s) for s in train]
    assert max(lengths) == 32 and min(lengths) >= 2 and sum(n < 32 for n in lengths) > len(lengths) / 10
