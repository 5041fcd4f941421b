"""A Hugging Face GPT-2 over padded sequences of different lengths, trained through fit in micro-batches:
with the items its loss is a mean over (the shifted labels that count), the gradient is the whole
batch's; counted by samples it is far off. A tiny model built here, nothing downloaded."""

import pytest
import torch

import gputui

transformers = pytest.importorskip("transformers")


def make_model():
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_head=2, n_embd=32, vocab_size=100, n_positions=64, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0
    )
    return transformers.GPT2LMHeadModel(config)


def padded_batch():
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([60] + [8] * 7)  # one long sequence, seven short ones
    ids = torch.randint(100, (8, 60), generator=g)
    mask = (torch.arange(60) < lengths[:, None]).long()
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def step(model, batch):
    return model(**batch).loss


def relative_error(micro_batch, items):
    batch = padded_batch()
    ref = make_model()
    step(ref, batch).backward()
    expected = [p.grad.clone() for p in ref.parameters()]
    model, grads = make_model(), []

    class Capture(torch.optim.SGD):
        def step(self, closure=None):
            grads.extend(p.grad.clone() for p in model.parameters())
            return super().step(closure)

    gputui.fit(model, [batch], step, Capture(model.parameters(), lr=0.0), micro_batch=micro_batch, items=items)
    diff = sum(float((g - e).norm() ** 2) for g, e in zip(grads, expected, strict=True))
    return (diff / sum(float(e.norm() ** 2) for e in expected)) ** 0.5


@pytest.mark.parametrize("micro_batch", [2, 3])
def test_gpt2_token_mean_survives_micro_batching(micro_batch):
    assert relative_error(micro_batch, lambda b: (b["labels"][:, 1:] != -100).sum()) < 1e-5
    assert relative_error(micro_batch, None) > 0.3  # by samples: the 2024 accumulation bug
