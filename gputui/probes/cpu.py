"""Training-state bytes on a device without a caching allocator, and an optional budget.

A CPU has no `memory_stats()`, so gputui counts what training holds: parameters, gradients,
optimizer state and the activations autograd saves for backward (through
`saved_tensors_hooks`). With a budget, crossing it raises a real `torch.OutOfMemoryError`
from inside forward, backward or the optimizer step: the same exception, at the same places,
as a GPU running out, so the whole recovery path runs on any machine.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterable, Iterator

import torch

from ..telemetry.sample import Memory
from ..units import format_bytes
from . import host


def storage_key(t: torch.Tensor) -> tuple[int, int]:
    """(storage address, storage bytes); views of one storage share it, so they count once."""
    try:
        storage = t.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError):  # tensors without a plain storage
        return id(t), t.numel() * t.element_size()


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors`."""
    seen: dict[int, int] = {}
    for t in tensors:
        ptr, size = storage_key(t)
        seen[ptr] = size
    return sum(seen.values())


class StateTracker:
    """Counts training-state bytes as they appear; raises OutOfMemoryError past `budget`.

    The counters change only on the training thread; readers take a snapshot of ints.
    """

    def __init__(self, model: torch.nn.Module | Iterable[torch.Tensor], optimizer: torch.optim.Optimizer,
                 budget: int | None) -> None:
        """`model`: the module, or its parameters (a script's own loop shows only its optimizer's)."""
        self.budget = budget
        self.optimizer = optimizer
        self._params = list(model.parameters() if isinstance(model, torch.nn.Module) else model)
        self.params = tensor_bytes(self._params)
        self._param_keys = frozenset(storage_key(p)[0] for p in self._params)
        self.grads = 0
        self._has_grad: set[int] = set()
        self.optimizer_bytes = 0
        self._optimizer_entries = -1
        self.activations = 0
        self._saved: set[int] = set(self._param_keys)
        self.peak = 0
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._on_grad) for p in self._params if p.requires_grad
        ]
        self._sync_grads()
        self.optimizer_bytes = tensor_bytes(state_tensors(optimizer))
        self._optimizer_entries = len(optimizer.state)

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer_bytes + self.activations

    # -- counting ---------------------------------------------------------------------------
    def _grow(self, phase: str, asked: int) -> None:
        total = self.total
        if total > self.peak:
            self.peak = total
        if self.budget is not None and total > self.budget:
            raise torch.OutOfMemoryError(self.oom_message(phase, asked))

    def oom_message(self, phase: str, asked: int) -> str:
        return (
            f"CPU memory budget exceeded in {phase}: tried to hold {format_bytes(asked)} more, "
            f"{format_bytes(self.total)} of the {format_bytes(self.budget)} budget "
            f"(parameters {format_bytes(self.params)}, gradients {format_bytes(self.grads)}, "
            f"optimizer state {format_bytes(self.optimizer_bytes)}, "
            f"saved activations {format_bytes(self.activations)})"
        )

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        ptr, size = storage_key(t)
        if ptr not in self._saved:
            self._saved.add(ptr)
            self.activations += size
            self._grow("forward", size)
        return t

    def note_saved(self, tensors: Iterable[object]) -> None:
        """Count tensors kept alive outside autograd's saved tensors (checkpointed block inputs)."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._pack(t)

    def _on_grad(self, param: torch.Tensor) -> None:
        key = id(param)
        if key not in self._has_grad and param.grad is not None:
            self._has_grad.add(key)
            size = param.grad.numel() * param.grad.element_size()
            self.grads += size
            self._grow("backward", size)

    def _sync_grads(self) -> None:
        self._has_grad = {id(p) for p in self._params if p.grad is not None}
        self.grads = tensor_bytes(p.grad for p in self._params if p.grad is not None)

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        """Around forward: counts each tensor autograd saves for backward."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
            yield

    def end_micro_batch(self) -> None:
        """Backward has freed the saved activations of this micro-batch."""
        self.activations = 0
        self._saved = set(self._param_keys)

    def refresh_optimizer(self) -> None:
        """Optimizer state appears at the first step; recount only when its entries change."""
        entries = len(self.optimizer.state)
        if entries != self._optimizer_entries:
            self._optimizer_entries = entries
            self.optimizer_bytes = tensor_bytes(state_tensors(self.optimizer))
            self._grow("optimizer", self.optimizer_bytes)

    def reset(self) -> None:
        """After zero_grad(set_to_none=True), or after an OOM dropped everything of the step."""
        self.end_micro_batch()
        self._sync_grads()

    def start_step(self) -> None:
        self.peak = self.total

    def breakdown(self) -> dict[str, int]:
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer_bytes,
                "activations": self.activations}

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


def state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The tensors in an optimizer's state, which custom optimizers may nest in dicts or lists."""
    found: list[torch.Tensor] = []
    pending: list[Any] = list(optimizer.state.values())
    while pending:
        v = pending.pop()
        if isinstance(v, torch.Tensor):
            found.append(v)
        elif isinstance(v, dict):
            pending.extend(v.values())
        elif isinstance(v, (list, tuple)):
            pending.extend(v)
    return found


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


class CpuProbe:
    """Readings for a CPU device: the tracked training state, the budget as capacity, and RSS."""

    name = "CPU"

    def __init__(self, tracker: StateTracker) -> None:
        self.tracker = tracker

    def start_step(self) -> None:
        self.tracker.start_step()

    def allocated(self) -> int:
        return self.tracker.total

    def read(self) -> Memory:
        t = self.tracker
        return Memory(device="cpu", allocated=t.total, peak=t.peak, capacity=t.budget,
                      rss=host.rss(max_age=host.RSS_MAX_AGE), **t.breakdown())

    def free_cache(self) -> dict[str, Any]:
        before, after = host.release_free_memory()
        return {"bytes": before - after, "rss_before": before, "rss_after": after}
