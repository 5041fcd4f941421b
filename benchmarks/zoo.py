"""Models unlike the demos, for what fit costs beside shapes of training the demos do not have: BatchNorm
buffers saved every step, a dict batch with padding and dropout, hundreds of parameter tensors, a
recurrent net. Each maker returns (model, batches, step, samples a batch, description); workloads.py
wraps them as it does the demos'."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

Made = tuple[nn.Module, list[Any], Callable[[nn.Module, Any], torch.Tensor], int, str]


class _Residual(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))


def _classify(model: nn.Module, batch: Any) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def cnn(g: torch.Generator, batch: int | None, distinct: int) -> Made:
    batch = batch or 32
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1, bias=False),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        *[_Residual(16) for _ in range(4)],
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 10),
    )
    batches = [
        (torch.randn(batch, 3, 16, 16, generator=g), torch.randint(10, (batch,), generator=g)) for _ in range(distinct)
    ]
    return (
        model,
        batches,
        _classify,
        batch,
        f"a ResNet-like CNN with BatchNorm (9 convolutions, 16x16 images), batch {batch}, AdamW",
    )


class _Encoder(nn.Module):
    """A Hugging Face-shaped model: keyword inputs, an output dict with the loss."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, 64)
        layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)
        self.head = nn.Linear(64, vocab)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
        hidden = self.encoder(self.embed(input_ids), src_key_padding_mask=attention_mask == 0)
        logits = self.head(hidden)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        return {"loss": loss, "logits": logits}


def encoder(g: torch.Generator, batch: int | None, distinct: int) -> Made:
    batch, seq, vocab = batch or 16, 32, 500
    batches = []
    for _ in range(distinct):
        ids = torch.randint(vocab, (batch, seq), generator=g)
        lengths = torch.randint(seq // 2, seq + 1, (batch,), generator=g)
        mask = (torch.arange(seq) < lengths[:, None]).long()
        batches.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    return (
        _Encoder(vocab),
        batches,
        lambda model, b: model(**b)["loss"],
        batch,
        f"a Hugging Face-shaped encoder (4 layers, width 64, dropout; dict batches padded to {seq}), batch {batch}, AdamW",
    )


def _regress(model: nn.Module, batch: Any) -> torch.Tensor:
    return F.mse_loss(model(batch[0]), batch[1])


def deep(g: torch.Generator, batch: int | None, distinct: int) -> Made:
    batch, layers = batch or 64, 100
    model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(layers)], nn.Linear(16, 1))
    batches = [(torch.randn(batch, 16, generator=g), torch.randn(batch, 1, generator=g)) for _ in range(distinct)]
    return model, batches, _regress, batch, f"{layers} layers of width 16, batch {batch}, AdamW"


class _Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(32, 64, 2, batch_first=True, dropout=0.2)
        self.head = nn.Linear(64, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(x)[0][:, -1])


def lstm(g: torch.Generator, batch: int | None, distinct: int) -> Made:
    batch = batch or 16
    batches = [
        (torch.randn(batch, 20, 32, generator=g), torch.randint(5, (batch,), generator=g)) for _ in range(distinct)
    ]
    return (
        _Recurrent(),
        batches,
        _classify,
        batch,
        f"a 2-layer LSTM with dropout (20 steps of 32 features), batch {batch}, AdamW",
    )


MAKERS: dict[str, Callable[[torch.Generator, int | None, int], Made]] = {
    "cnn": cnn,
    "encoder": encoder,
    "deep": deep,
    "lstm": lstm,
}
