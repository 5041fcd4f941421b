"""Small models and a plain PyTorch loop the engine is compared against (none of them in gputui)."""

from __future__ import annotations

import copy
import threading

import torch
from torch import nn
from torch.nn import functional as F


class ConvNet(nn.Module):
    """A conv net with repeated residual blocks in an nn.Sequential (checkpointing finds them);
    `batch_norm`: BatchNorm in the blocks, whose running statistics change in training."""

    def __init__(self, channels: int = 8, blocks: int = 3, classes: int = 5, batch_norm: bool = False) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.body = nn.Sequential(*(Residual(channels, batch_norm) for _ in range(blocks)))
        self.head = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.body(self.stem(x))
        return self.head(x.mean(dim=(2, 3)))


class Residual(nn.Module):
    def __init__(self, channels: int, batch_norm: bool = False) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.norm = nn.BatchNorm2d(channels) if batch_norm else nn.GroupNorm(2, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.norm(self.conv(x)))


class TokenModel(nn.Module):
    """Embedding + GRU + per-token head: batches are dicts with a mask; layers in a ModuleList."""

    def __init__(self, vocab: int = 20, width: int = 16, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
        self.rnn = nn.GRU(width, width, batch_first=True)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = x + torch.relu(layer(x))
        return self.head(self.rnn(x)[0])


def conv_step(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def token_step(model: nn.Module, batch) -> torch.Tensor:
    logits = model(batch["tokens"])
    loss = F.cross_entropy(logits.flatten(0, 1), batch["target"].flatten(), reduction="none")
    return loss.mean()


def conv_batches(n: int, size: int, seed: int = 0, last: int | None = None):
    g = torch.Generator().manual_seed(seed)
    sizes = [size] * n if last is None else [size] * (n - 1) + [last]
    return [(torch.randn(s, 3, 6, 6, generator=g), torch.randint(5, (s,), generator=g)) for s in sizes]


def token_batches(n: int, size: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [
        {
            "tokens": torch.randint(20, (size, 7), generator=g),
            "target": torch.randint(20, (size, 7), generator=g),
            "lang": "xx",
        }
        for _ in range(n)
    ]


def padded_batches(n: int, size: int, seed: int = 0):
    """Hugging Face-shaped batches of variable-length sequences: labels -100 past each one's length
    (one long sequence, the others short, so a token mean is far from a mean of sample means)."""
    g = torch.Generator().manual_seed(seed)
    batches = []
    for b in range(n):
        lengths = torch.randint(1, 3, (size,), generator=g)
        lengths[b % size] = 7
        labels = torch.randint(20, (size, 7), generator=g)
        labels[torch.arange(7) >= lengths[:, None]] = -100
        batches.append({"input_ids": torch.randint(20, (size, 7), generator=g), "labels": labels})
    return batches


def padded_step(model: nn.Module, batch) -> torch.Tensor:
    """The mean over the tokens that count, as a Hugging Face causal LM's loss is."""
    logits = model(batch["input_ids"])
    return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)


def count_tokens(batch) -> torch.Tensor:
    return (batch["labels"] != -100).sum()


def plain_loop(model: nn.Module, batches, step, make_optimizer, epochs: int = 1, scheduler=None):
    """The reference: one optimizer step per global batch, no gputui."""
    optimizer = make_optimizer(model)
    sched = scheduler(optimizer) if scheduler else None
    for _ in range(epochs):
        for batch in batches:
            loss = step(model, batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if sched:
                sched.step()
    return model


def micro_batches_used(result, initial: int) -> list[int]:
    """The micro-batch each step of a fit trained with, from its oom_recovered events (an OOM
    in step i is reported at step i-1)."""
    sizes, size = [], initial
    changes = {e.step: e["micro_batch_to"] for e in result.events if e.name == "oom_recovered"}
    for i in range(result.steps):
        size = changes.get(i, size)
        sizes.append(size)
    return sizes


def plain_accumulating_loop(model: nn.Module, batches, step, optimizer, micro_batches) -> nn.Module:
    """The reference for a fit whose micro-batch changed: each batch (a tuple of tensors) in the
    given micro-batches, each loss weighted by its share, one optimizer step a batch, no OOM."""
    for batch, size in zip(batches, micro_batches, strict=True):
        total = len(batch[0])
        pieces = list(zip(*(t.split(size) for t in batch), strict=True))
        for piece in pieces:
            loss = step(model, piece)
            (loss * (len(piece[0]) / total) if len(pieces) > 1 else loss).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model


def assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], **tolerance) -> None:
    """The same names, and each name's tensors close: matched by name, so neither a missing or extra
    entry nor a different order passes."""
    assert a.keys() == b.keys(), f"different names: {sorted(a.keys() ^ b.keys())}"
    for name, x in a.items():
        torch.testing.assert_close(x, b[name], **tolerance, msg=lambda m, name=name: f"{name}: {m}")


def assert_same_buffers(a: nn.Module, b: nn.Module) -> None:
    """Running statistics (running_mean, running_var, num_batches_tracked) equal to the last bit."""
    assert_same_tensors(dict(a.named_buffers()), dict(b.named_buffers()), atol=0, rtol=0)


def twins(factory, seed: int = 0):
    torch.manual_seed(seed)
    a = factory()
    return a, copy.deepcopy(a)


def assert_same_weights(a: nn.Module, b: nn.Module, atol: float = 1e-5, rtol: float = 1e-4) -> None:
    assert_same_tensors(dict(a.named_parameters()), dict(b.named_parameters()), atol=atol, rtol=rtol)


class Sink:
    """A hub sink that ignores everything: subclasses override what they watch."""

    def on_start(self, info):
        pass

    def on_sample(self, sample):
        pass

    def on_event(self, event):
        pass

    def on_end(self, summary):
        pass


class EventSeen(Sink):
    """A hub sink that releases `each` at every event called `name`: a thread waits on it, no polling."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.each = threading.Semaphore(0)

    def on_event(self, event):
        if event.name == self.name:
            self.each.release()


def on_event(hub, name: str, action, timeout: float = 10.0) -> threading.Thread:
    """Run `action` on another thread as soon as the hub emits an event called `name` (or has one already)."""
    seen = EventSeen(name)
    hub.add_sink(seen)
    if any(e.name == name for e in hub.events()):
        seen.each.release()

    def watch() -> None:
        try:
            if seen.each.acquire(timeout=timeout):
                action()
        finally:
            hub.remove_sink(seen)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


class RequestAt(Sink):
    """A hub sink that requests `action` once the loop has published step `n`."""

    def __init__(self, hub, n, action, value=None):
        self.hub, self.n, self.action, self.value = hub, n, action, value

    def on_sample(self, sample):
        if sample.step == self.n:
            self.hub.controls.request(self.action, self.value)


def halving_only(monkeypatch) -> None:
    """OOM recovery halves, as it does when nothing can be predicted: the tests of replay itself want
    the several retries of a budget (the planner would pick the micro-batch that fits at once)."""
    from gputui.plan import Planner

    monkeypatch.setattr(Planner, "after_oom", lambda *args, **kwargs: None)


def thrashing_allocator(monkeypatch) -> None:
    """fit's probe reports allocator retries growing at every step, as a thrashing CUDA allocator would."""
    import dataclasses

    import gputui.engine.session as session

    real = session.for_device

    def thrashing_probe(device, tracker, **kwargs):
        probe = real(device, tracker, **kwargs)
        read, count = probe.read, iter(range(0, 1000, 2))
        probe.read = lambda: dataclasses.replace(read(), alloc_retries=next(count))
        return probe

    monkeypatch.setattr(session, "for_device", thrashing_probe)
