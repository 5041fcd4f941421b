"""Small models and a plain PyTorch loop the engine is compared against (none of them in gputui)."""

from __future__ import annotations

import contextlib
import copy
import math
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


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def overflowing(blow_up_at: int):
    """A step (for Tiny) whose loss, at its `blow_up_at`-th call, is finite but large enough that the scaled
    gradients overflow fp16 in the backward (as a GradScaler's scale too high does): that step is skipped."""
    calls = [0]

    def step(model: nn.Module, batch) -> torch.Tensor:
        calls[0] += 1
        loss = F.mse_loss(model(batch[0]).float(), batch[1])
        return loss * 1e30 if calls[0] == blow_up_at else loss

    return step


def fp16_clipped_loop(model: nn.Module, batches, step, optimizer, clip: float) -> list[float]:
    """The reference under fp16, as torch's AMP recipe writes it, with clipping: the norms clip_grad_norm_
    returned (inf or nan where the GradScaler skipped the step, which must leave the weights as they were)."""
    device = next(model.parameters()).device.type
    scaler, norms = torch.amp.GradScaler(device), []
    for batch in batches:
        before = [p.detach().clone() for p in model.parameters()]
        with torch.autocast(device, dtype=torch.float16):
            loss = step(model, batch)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        kept = all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
        assert kept == (not math.isfinite(norms[-1])), "a step is skipped exactly when its norm is not finite"
    return norms


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


@contextlib.contextmanager
def own_process():
    """Another process's telemetry for the block: a fit in it (a warm-up, a second script) is not part of
    the test's run, which every fit of one process continues (engine/continuity.py)."""
    from gputui.telemetry import hub as hubs

    outer = hubs.current()
    hubs.install(hubs.Hub())
    try:
        yield
    finally:
        hubs.install(outer)


class RequestAt(Sink):
    """A hub sink that requests `action` once the loop has published `n` steps since it was added (a fit
    after others in the test's process counts on from theirs: its own n-th step)."""

    def __init__(self, hub, n, action, value=None):
        self.hub, self.n, self.action, self.value = hub, n, action, value
        self.seen = 0

    def on_sample(self, sample):
        self.seen += 1
        if self.seen == self.n:
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
        probe.read = probe.step_reading = lambda *now: dataclasses.replace(read(), alloc_retries=next(count))
        return probe

    monkeypatch.setattr(session, "for_device", thrashing_probe)


GPU_STATS = {  # torch.cuda.memory_stats() keys the probe reads, as a GPU mid-run gives them
    "allocated_bytes.all.current": 3 << 20,
    "reserved_bytes.all.current": 8 << 20,
    "inactive_split_bytes.all.current": 0,
    "allocated_bytes.all.peak": 5 << 20,
    "active_bytes.all.current": 3 << 20,
    "num_alloc_retries": 0,
    "num_ooms": 0,
}


def nested(stats: dict) -> dict:
    """memory_stats()'s flat keys ("allocated_bytes.all.current") as memory_stats_as_nested_dict() gives them."""
    out: dict = {}
    for key, value in stats.items():
        *path, last = key.split(".")
        at = out
        for part in path:
            at = at.setdefault(part, {})
        at[last] = value
    return out


def stand_in_gpu(monkeypatch, total: int = 8 << 30) -> None:
    """torch.cuda's memory functions stood in for, so that gputui's CUDA code (CudaProbe, a session
    on cuda:0) runs on this CPU as on one GPU with GPU_STATS; NVML is left out."""
    import gputui.engine.session as session

    for name, value in {
        "get_device_name": lambda device=None: "stand-in GPU",
        "mem_get_info": lambda device=None: (total // 2, total),
        "memory_stats": lambda device=None: dict(GPU_STATS),
        "memory_stats_as_nested_dict": lambda device=None: nested(GPU_STATS),
        "get_per_process_memory_fraction": lambda device=None: 1.0,
        "memory_allocated": lambda device=None: GPU_STATS["allocated_bytes.all.current"],
        "memory_reserved": lambda device=None: GPU_STATS["reserved_bytes.all.current"],
        "reset_peak_memory_stats": lambda device=None: None,
        "set_per_process_memory_fraction": lambda fraction, device=None: None,
        "empty_cache": lambda: None,
    }.items():
        monkeypatch.setattr(torch.cuda, name, value)
    monkeypatch.setattr(session, "_nvml_view", lambda hub, device: None)


class HistoryStandIn:
    """torch's memory history and snapshot calls stood in for (a CPU build has none): what gputui asked
    of them. `backend`: the allocator torch would say it runs; cudaMallocAsync raises as torch does."""

    def __init__(self, monkeypatch, backend: str = "native") -> None:
        self.calls: list[tuple[str | None, dict]] = []
        self.on = False
        self.backend = backend

        def record(enabled="all", **kwargs):
            if backend != "native":
                raise RuntimeError(f"{backend} does not yet support recordHistory.")
            self.calls.append((enabled, kwargs))
            self.on = enabled is not None

        def dump(path):
            if backend != "native":
                raise RuntimeError(f"Calling snapshot with backend:{backend} is not meaningful.")
            with open(path, "wb") as f:
                f.write(b"stand-in snapshot")

        monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", record)
        monkeypatch.setattr(torch._C, "_cuda_isHistoryEnabled", lambda: self.on, raising=False)
        monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", dump)
        monkeypatch.setattr(torch.cuda, "memory_summary", lambda device=None: "stand-in memory_summary()")
        monkeypatch.setattr(torch.cuda, "get_allocator_backend", lambda: backend)
