"""Training-state bytes on a device without a caching allocator, and an optional budget.

A CPU has no `memory_stats()`, so gputui counts what training holds: parameters, gradients,
optimizer state and the activations autograd saves for backward (through
`saved_tensors_hooks`). With a budget, crossing it raises a real `torch.OutOfMemoryError`
from inside forward, backward or the optimizer step: the same exception, at the same places,
as a GPU running out, so the whole recovery path runs on any machine.

Activations are storage the step made: a saved tensor whose storage was there before the step (a
parameter, the batch, a data set held as one tensor that the batch is a slice of) is held whatever
the micro-batch, so counting it would only make a small budget fit no sample at all. On a device,
what moving a piece of the batch there made is the step's, and counts.

Counting saved activations costs a Python call per saved tensor (~5 us). Without a budget, nothing
depends on the count mid-step, so a step shaped like one counted less than RECOUNT_S ago (same
micro-batch, AMP, checkpointing, batch shapes and optimizer state: the same tensors are saved) is
not counted again and reports that step's peak.
"""

from __future__ import annotations

import contextlib
import gc
import sys
import time
from collections.abc import Callable, Hashable, Iterable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch.nn.parameter import is_lazy

from ..telemetry.sample import Memory
from ..units import format_bytes
from . import PacedReadings, host

RECOUNT_S = 1.0
"""Without a budget, a step's activations are counted again at least this often, whatever its shape."""


def storage_key(t: torch.Tensor) -> tuple[int, int]:
    """(storage address, storage bytes); views of one storage share it, so they count once. A Lazy
    module's parameter not made yet (before its first forward) has no bytes."""
    try:
        storage = t.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError, ValueError):  # tensors without a plain storage
        return id(t), 0 if is_lazy(t) else t.numel() * t.element_size()


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors`."""
    seen: dict[int, int] = {}
    for t in tensors:
        ptr, size = storage_key(t)
        seen[ptr] = size
    return sum(seen.values())


def hidden_from_dynamo(hook: Any) -> Any:
    """`hook` made invisible to torch.compile. Autograd calls hooks from inside a compiled model's
    eager parts (around graph breaks), where dynamo would compile each hook as a frame of its own and
    recompile it past its limit (grad mode differs between forward and backward), warning each
    time. torch._dynamo is loaded by torch.compile and by every torch.optim optimizer's constructor
    (torch 2.13), so a run almost always has it: a wrapped hook then costs ~0.25 us a call. Where it
    is not loaded (importing it costs ~1.5 s), nothing can compile, and the hook is returned as it is."""
    if "torch._dynamo" not in sys.modules:
        return hook
    return torch.compiler.disable(hook)


class StateTracker:
    """Counts training-state bytes as they appear; raises OutOfMemoryError past `budget`.

    The counters change only on the training thread; readers take a snapshot of ints.
    """

    def __init__(
        self, model: torch.nn.Module | Iterable[torch.Tensor], optimizer: torch.optim.Optimizer, budget: int | None
    ) -> None:
        """`model`: the module, or its parameters (a script's own loop shows only its optimizer's)."""
        self.budget = budget
        self.optimizer = optimizer
        self._params = list(model.parameters() if isinstance(model, torch.nn.Module) else model)
        # A Lazy module's parameters, made in its first forward: counted from then on.
        self._lazy: list[torch.Tensor] = [p for p in self._params if is_lazy(p)]
        self._take_params()
        self.grads = 0
        self._has_grad: set[int] = set()
        self.optimizer_bytes = 0
        self._optimizer_entries = -1
        self.activations = 0
        self._inputs: set[int] = set()  # the storages of the step's batch: there before it, not its activations
        self.peak = 0
        self.counting = True  # the step under way counts its saved activations
        self._shape: tuple[Hashable, int] | None = None  # the counted step under way's shape
        self._started = 0.0
        self._counted: tuple[Any, int, float] = (None, 0, 0.0)  # (shape, peak, start) of the last counted step
        self._hooks: list[Any] = []
        self._hook_grads()
        self.sync_grads()
        self.optimizer_bytes = tensor_bytes(state_tensors(optimizer))
        self._optimizer_entries = len(optimizer.state)

    def _take_params(self) -> None:
        self.params = tensor_bytes(self._params)
        self._param_keys = frozenset(storage_key(p)[0] for p in self._params)
        self._keys = len(self._param_keys)  # len(_saved) past it: activations were saved since the last free
        self._saved: set[int] = set(self._param_keys)

    def _hook_grads(self) -> None:
        """Only a budget needs to see each gradient appear (to raise inside backward where it is crossed);
        without one, counting them once after backward gives the same peak without a Python call per
        parameter per step (about 4 us each)."""
        if self.budget is not None:
            on_grad = hidden_from_dynamo(self._on_grad)
            hooked = (p for p in self._params if p.requires_grad and not is_lazy(p))  # a lazy one: once made
            self._hooks = [p.register_post_accumulate_grad_hook(on_grad) for p in hooked]

    def _made(self, lazy: list[torch.Tensor]) -> None:
        """Some of the Lazy modules' parameters were made (their first forward ran): counted from this step
        on; `lazy`: those still to make (a branch not run yet)."""
        self._lazy = lazy
        for hook in self._hooks:
            hook.remove()
        self._take_params()
        self._hook_grads()

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

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        """The saved-tensors pack hook: count `t`'s storage once."""
        ptr, size = storage_key(t)
        if ptr not in self._saved and ptr not in self._inputs:
            self._saved.add(ptr)
            self.activations += size
            self._grow("forward", size)
        # Detached (autograd puts the grad_fn back on unpack): an output saved by its own grad_fn,
        # kept with that grad_fn, is a cycle through C++ that gc cannot break, so a graph that
        # never reaches backward (an attempt cut short by an OOM) would never be freed.
        return t.detach()

    def note_saved(self, tensors: Iterable[object]) -> None:
        """Count tensors kept alive outside autograd's saved tensors (checkpointed block inputs). A hook
        too (a checkpointed block's forward calls it): whoever hands it on hides it from dynamo, as pack."""
        if not self.counting:
            return
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self.pack(t)

    def _on_grad(self, param: torch.Tensor) -> None:
        key = id(param)
        if key not in self._has_grad and param.grad is not None:
            self._has_grad.add(key)
            size = param.grad.numel() * param.grad.element_size()
            self.grads += size
            self._grow("backward", size)

    def sync_grads(self) -> None:
        """Count the gradients there are now: numel x element size, as _on_grad does (gradients are
        disjoint tensors; a storage lookup each would double the cost)."""
        grads = [g for p in self._params if (g := p.grad) is not None]
        self.grads = sum(g.numel() * g.element_size() for g in grads) if grads else 0  # not .nbytes: sparse has none
        if self._hooks:  # without them _on_grad never runs: _has_grad stays empty
            self._has_grad = {id(p) for p in self._params if p.grad is not None}

    def saving(self) -> AbstractContextManager[Any]:
        """Around forward: counts each tensor autograd saves for backward (if this step counts)."""
        if not self.counting:
            return _NOT_COUNTING
        # Hidden here, not once in __init__: a tracker holding a wrapper of its own bound method is a
        # cycle, and the optimizer it holds (its state on the device) outlived fit() until a collection.
        return torch.autograd.graph.saved_tensors_hooks(hidden_from_dynamo(self.pack), hidden_from_dynamo(unpack))

    def end_micro_batch(self) -> None:
        """After backward: its gradients are all there (counted now unless hooks saw each arrive, the
        step's peak with them), and the saved activations of this micro-batch are freed."""
        if not self._hooks and self.counting:  # uncounted, the step's peak is known already
            self.sync_grads()
            self._grow("backward", 0)
        if len(self._saved) != self._keys:  # else nothing was saved (a step not counted): nothing to free
            self._free_activations()

    def _free_activations(self) -> None:
        self.activations = 0
        self._saved = set(self._param_keys)

    def refresh_optimizer(self) -> None:
        """Optimizer state appears at the first step; recount only when its entries change."""
        entries = len(self.optimizer.state)
        if entries != self._optimizer_entries:
            self._optimizer_entries = entries
            self.optimizer_bytes = tensor_bytes(state_tensors(self.optimizer))
            self._grow("optimizer", self.optimizer_bytes)
        if self.counting and self._shape is not None:  # the step is complete: its peak is known
            self._counted = (self._shape, self.peak, self._started)

    def reset(self) -> None:
        """After zero_grad(set_to_none=True), or after an OOM dropped everything of the step. A step not
        counted changed no count (nothing saved, its gradients not counted): the gradients that outlive
        zero_grad are the ones the last counted step's reset found, and nothing is walked."""
        if not self.counting:
            return
        if len(self._saved) != self._keys:
            self._free_activations()
        self.sync_grads()

    def start_step(self, shape: Hashable | None = None, inputs: Callable[[], Iterable[torch.Tensor]] = tuple) -> None:
        """A step (or a retry of one) begins; `shape`: what its saved activations depend on, if the
        caller knows (see the module doc); `inputs()`: its batch's tensors, whose storages (a data set
        the batch was sliced from, say) are not its activations (asked only of a step that counts).
        Decides whether this step counts them."""
        if self._lazy:
            lazy: list[torch.Tensor] = [p for p in self._lazy if is_lazy(p)]
            if len(lazy) < len(self._lazy):
                self._made(lazy)
        now = time.monotonic()
        shape = None if shape is None else (shape, self._optimizer_entries)
        last_shape, last_peak, last_start = self._counted
        self.counting = self.budget is not None or shape is None or shape != last_shape or now - last_start >= RECOUNT_S
        self._shape, self._started = (shape, now) if self.counting else (None, 0.0)
        if self.counting:
            self._inputs = {storage_key(t)[0] for t in inputs()}
        total = self.params + self.grads + self.optimizer_bytes + self.activations  # self.total, without its call
        self.peak = total if self.counting else max(total, last_peak)

    def breakdown(self) -> dict[str, int]:
        return {
            "params": self.params,
            "grads": self.grads,
            "optimizer": self.optimizer_bytes,
            "activations": self.activations,
        }

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


_NOT_COUNTING = contextlib.nullcontext()


def unpack(t: torch.Tensor) -> torch.Tensor:
    return t


class CpuProbe(PacedReadings):
    """Readings for a CPU device: the tracked training state, the budget as capacity, and RSS. After steps
    it reads at most every STEP_READ_S, as the CUDA probe does, each reading's peak the largest of the
    steps since the one before."""

    name = "CPU"
    over_limit: dict[str, int] | None = None

    def __init__(self, tracker: StateTracker) -> None:
        self.tracker = tracker
        self._last: tuple[tuple[int | None, ...], Memory] | None = None
        self._peak = 0  # the largest step peak since the last reading

    start_step = None
    """Nothing to reset at a step's start (a call a step saved): the tracker's step is started by whoever drives it."""

    def allocated(self) -> int:
        return self.tracker.total

    def capacity(self) -> int | None:
        return self.tracker.budget

    def step_reading(self, now: float) -> Memory | None:
        """After a step: its peak kept for the next reading, which is made at most every STEP_READ_S."""
        peak = self.tracker.peak
        if peak > self._peak:
            self._peak = peak
        return super().step_reading(now)

    def read(self) -> Memory:
        """A reading now, its peak the largest of the steps since the last reading; the last record again
        while no figure changed (RSS is read a few times a second)."""
        t = self.tracker
        peak = max(self._peak, t.peak)
        self._peak, self._step_read_at = 0, float("-inf")  # what changed is shown after the next step
        key = (t.params, t.grads, t.optimizer_bytes, t.activations, peak, t.budget, host.rss(host.RSS_MAX_AGE))
        last = self._last
        if last is not None and last[0] == key:
            return last[1]
        params, grads, optimizer, activations, peak, budget, rss = key
        memory = Memory(
            device="cpu",
            allocated=params + grads + optimizer + activations,
            peak=peak,
            capacity=budget,
            rss=rss,
            params=params,
            grads=grads,
            optimizer=optimizer,
            activations=activations,
        )
        self._last = (key, memory)
        return memory

    def free_cache(self) -> dict[str, Any]:
        before, after = host.release_free_memory()
        self._step_read_at = float("-inf")  # the next step's reading shows what went
        return {"bytes": before - after, "rss_before": before, "rss_after": after}

    def close(self) -> None:
        """Nothing of the process's to put back: the tracker is the session's to close."""

    def after_oom(self, baseline: int) -> None:
        """A failed attempt's memory goes back to glibc as its last reference goes (its frames are
        cleared); what glibc keeps, the retry reuses (trimming it would only hand the pages back for
        the retry to fault them in again), and the tracker's count was reset. What is left is a cycle
        among the attempt's objects, young ones: the young generations' collection finds it in well
        under a millisecond, where a full one costs ~100 ms with torch loaded."""
        gc.collect(1)
        self._peak, self._step_read_at = 0, float("-inf")  # the replay's peak is its own
