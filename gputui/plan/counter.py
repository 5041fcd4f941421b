"""The count a trace makes: the bytes of the storages alive on one device, op by op, and what was alive
at the peak. A dispatch mode sees every op's outputs; each storage is registered once and freed by a
finalizer when it dies, so the peak comes out of the same ops the real step runs."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ..probes.cpu import state_tensors
from ..step.pieces import Progress
from . import blocks, private
from .prediction import Untraceable


class Counter(private.DispatchMode):
    """Live storage bytes on one device, op by op; the peak, its phase and its parts."""

    def __init__(
        self,
        device: torch.device,
        watch: Callable[[torch.Tensor], None],
        fake: Callable[[torch.Tensor], torch.Tensor],
        fake_type: type,
    ) -> None:
        super().__init__()
        self.device = device
        self.watch = watch  # each tensor seen (the Guard's)
        self.fake, self.fake_type = fake, fake_type  # the trace's fake of a real tensor the step brings
        self.blocks = blocks.rounding(device)  # a storage's bytes as the device's allocator counts them
        self.at = Progress()  # the step's phase, moved by run_pieces
        self.live: dict[int, int] = {}
        self.total = 0
        self.peak = 0
        self.peak_phase = "forward"
        self.peak_parts: dict[str, int] = {}
        self.fixed = 0  # parameters and buffers
        self.gradients = 0
        self.grads_seen: set[int] = set()  # parameters whose gradient this step is counted
        self.saved: dict[int, int] = {}  # storages autograd keeps for backward, alive
        self.saved_bytes = 0
        self.optimizer: torch.optim.Optimizer | None = None  # whose state counts as "optimizer"
        self.values_read = 0  # .item() and bool() of a tensor, answered with a stand-in
        self.holds: list[Any] = []  # finalizers, gradient hooks: what ties the copy to this counter

    def __exit__(self, *exc: Any) -> None:
        """The count is over: its finalizers and hooks go. Both are held where the garbage collector
        cannot see (the finalizer registry; a parameter's hooks, by C++), and each holds this counter, and
        through it the trace and its copy: every trace's copy would live as long as the process."""
        super().__exit__(*exc)
        for held in self.holds:
            held.detach() if isinstance(held, weakref.finalize) else held.remove()
        self.holds.clear()

    def add(self, t: torch.Tensor) -> None:
        self.watch(t)
        if t.device != self.device:
            return
        storage = t.untyped_storage()
        key = private.storage_key(storage)
        if key in self.live:
            return
        size = self.blocks(storage.nbytes())
        self.live[key] = size
        self.total += size
        self.holds.append(weakref.finalize(storage, self._free, key))
        if self.total > self.peak:
            self._new_peak()

    def optimizer_bytes(self) -> int:
        return 0 if self.optimizer is None else self.held(state_tensors(self.optimizer))

    def held(self, tensors: Iterable[torch.Tensor]) -> int:
        """The counted bytes of the live storages under `tensors`, each once."""
        return sum(self.live.get(key, 0) for key in storage_bytes(tensors))

    def _free(self, key: int) -> None:
        self.total -= self.live.pop(key, 0)
        self.saved_bytes -= self.saved.pop(key, 0)

    def _new_peak(self) -> None:
        self.peak, self.peak_phase = self.total, self.at.phase
        optimizer = self.optimizer_bytes()
        known = self.fixed + self.gradients + optimizer + self.saved_bytes
        self.peak_parts = {
            "parameters": self.fixed,
            "gradients": self.gradients,
            "optimizer": optimizer,
            "activations": self.saved_bytes,
            "temporaries": max(0, self.total - known),
        }

    def mark_saved(self, t: torch.Tensor) -> int:
        """A storage autograd keeps for backward: its bytes if newly kept, else 0."""
        key = private.storage_key(t.untyped_storage())
        if key in self.saved or key not in self.live:
            return 0
        self.saved[key] = self.live[key]
        self.saved_bytes += self.live[key]
        return self.live[key]

    def grad_arrived(self, p: torch.Tensor) -> None:
        """A parameter's gradient accumulated: counted once a step."""
        if id(p) not in self.grads_seen and p.grad is not None:
            self.grads_seen.add(id(p))
            self.gradients += self.blocks(p.grad.numel() * p.grad.element_size())

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is private.LOCAL_SCALAR:
            scalar: torch.Tensor = args[0]
            if not isinstance(scalar, self.fake_type):
                return private.real_value(scalar)  # a real tensor the step brings: its value is there
            if not private.is_constant(scalar):
                # A fake tensor has no value (a constant, like an optimizer's step count, has): a step that
                # logs its loss, or checks it, gets 1 (true) and the prediction says it was approximate (a
                # branch on the value may have gone the other way).
                self.values_read += 1
                return _stand_in(scalar.dtype)
        kwargs = kwargs or {}
        if func not in private.LIFTS and not (  # the fake mode makes torch.tensor(...) a constant
            _all_fake(args, self.fake_type) and _all_fake(kwargs.values(), self.fake_type)
        ):
            args, kwargs = self._fakes(args), dict(zip(kwargs, map(self._fakes, kwargs.values()), strict=True))
        out = func(*args, **kwargs)
        for t in private.leaves(out):
            if isinstance(t, torch.Tensor):
                self.add(t)
        return out

    def _fakes(self, arg: Any) -> Any:
        """An op's argument with each real tensor in it faked. Walked in methods and map(), no closure (pytree's
        map makes one, a comprehension is one): a traceback keeps a closure's frame and what the closure
        holds (this counter, the copy) after the frame is cleared, so a refused tensor left the trace alive
        and the Guard called it "kept" (Unsafe) where the step was only untraceable."""
        if isinstance(arg, torch.Tensor):
            return self._faked(arg)
        if isinstance(arg, (list, tuple)) and not _all_fake(arg, self.fake_type):  # torch.Size stays one
            return type(arg)(map(self._fakes, arg))
        if isinstance(arg, dict) and not _all_fake(arg.values(), self.fake_type):
            return type(arg)(zip(arg, map(self._fakes, arg.values()), strict=True))
        return arg

    def _faked(self, t: torch.Tensor) -> torch.Tensor:
        """A real tensor the step brings itself (class weights for the loss, a constant): its fake. One
        that requires grad cannot be swapped here (autograd, above, would accumulate into the real one)."""
        if isinstance(t, self.fake_type):
            return t
        if t.requires_grad:
            raise Untraceable(
                "step() uses a tensor that requires grad outside the model and the batch (a parameter of the "
                "loss?): only the model's own can be traced"
            )
        return self.fake(t)


def _all_fake(args: Iterable[Any], fake_type: type) -> bool:
    """Whether every tensor among an op's arguments is fake already, as nearly all are: then nothing is
    mapped (a walk of every op's arguments was a fifth of the trace's time). ATen's schemas hold tensors
    in lists and tuples; a custom op's may in a dict."""
    for a in args:
        if isinstance(a, torch.Tensor):
            if not isinstance(a, fake_type):
                return False
        elif isinstance(a, (list, tuple)) and not _all_fake(a, fake_type):
            return False
        elif isinstance(a, dict) and not _all_fake(a.values(), fake_type):
            return False
    return True


def _stand_in(dtype: torch.dtype) -> bool | int | float:
    if dtype is torch.bool:
        return True
    return 1.0 if dtype.is_floating_point or dtype.is_complex else 1


def storage_bytes(tensors: Iterable[torch.Tensor]) -> dict[int, int]:
    """Each storage under `tensors`, once, and its bytes."""
    return {private.storage_key(s): s.nbytes() for s in (t.untyped_storage() for t in tensors)}
