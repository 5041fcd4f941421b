"""What one training step would hold at its peak, traced on fake tensors before anything is allocated.

`predict()` runs the step fit() would run (micro-batches, autocast, checkpointing, backward, the
optimizer's step) on a copy of the model whose tensors are FakeTensors: shapes, dtypes and devices,
no data. A dispatch mode sees every op's outputs and keeps the bytes of the storages alive (each
registered once, freed by a finalizer when its storage dies), so the peak, its phase and what was
alive then come out of the same ops the real step would run. Extrapolating from a measured step
instead is off by 2-49 % and can get the direction wrong (a model whose peak is in the optimizer
step gains nothing from AMP, and halving its micro-batch raises its peak).

Nothing of the real run is touched: the copy shares no tensor with the model (a deepcopy whose memo
maps each tensor to its fake), the optimizer is rebuilt over the fake parameters with fake state,
checkpointing on the copy does not save and restore the process's RNG, and the RNG states are put
back anyway. The step's own code runs for real: guard.Guard puts back what it changed in the
script's objects and takes out the tensors it kept. Nothing of the copy outlives the call. Where a
step cannot be traced (a shape that depends on data, `.item()` deciding control
flow, a model that cannot be copied), `estimate()` scales a measured step instead and says so.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import random
import sys
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils.checkpoint import checkpoint

from .guard import Guard, Unsafe
from .probes.cpu import state_tensors
from .step.checkpointing import find_blocks, find_hugging_face
from .step.microbatch import batch_size, map_tensors, sizes, split, tensors, to_device
from .step.precision import AMP_DTYPES

PARTS = ("parameters", "gradients", "optimizer", "activations", "temporaries")
CUDA_BLOCK = 512
"""The CUDA caching allocator rounds every block up to this many bytes (max_memory_allocated counts blocks)."""


@dataclass(frozen=True)
class Prediction:
    """One step's predicted peak under one setting.

    `peak`: bytes of every storage on the device alive at once at the step's worst moment (what a GPU's
    caching allocator must hold: compare with `max_memory_allocated`, less what the script holds outside
    the step). `tracked_peak`: the same step as gputui's CPU tracker counts it (parameters, gradients,
    optimizer state and the activations saved for backward; no temporaries), which is what a CPU memory
    budget is checked against. `breakdown`: what was alive at `peak`, by PARTS.
    """

    peak: int
    tracked_peak: int
    phase: str
    breakdown: dict[str, int]
    micro_batch: int
    amp: str
    checkpointing: bool
    exact: bool
    reason: str | None = None
    seconds: float = 0.0

    def bytes_for(self, tracked: bool) -> int:
        """The peak a run compares with its capacity: the tracker's count under a CPU budget."""
        return self.tracked_peak if tracked else self.peak


class Untraceable(Exception):
    """The step cannot run on fake tensors; the message says why, in a line."""


def predict(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Any,
    step: Callable[[nn.Module, Any], torch.Tensor],
    *,
    micro_batch: int | None = None,
    amp: str = "off",
    checkpointing: bool = False,
    device: str | torch.device | None = None,
    checkpoint_modules: Sequence[nn.Module] | None = None,
    min_micro_batch: int = 1,
) -> Prediction:
    """The peak of one fit() step of `batch` under these settings, without allocating the step.

    `batch` is a global batch (real or fake tensors; only shapes are read). `micro_batch=None`: the
    whole batch at once. `device`: where the step runs (default: the model's parameters'). Raises
    Untraceable when the step cannot be traced: see estimate() for the fallback.
    """
    started = time.perf_counter()
    target = _device(model, device)
    total = batch_size(batch)
    size = min(micro_batch or total, total)
    with _Restored(target), Guard(step, model) as guard:
        try:
            peak, tracked, phase, parts, reason = _traced(
                model, optimizer, batch, target, guard.watch, step, size, total, amp, checkpointing,
                checkpoint_modules, min_micro_batch,
            )  # fmt: skip
        except Untraceable:
            raise
        except Exception as exc:
            raise Untraceable(_why(exc)) from exc
    return Prediction(
        peak=peak,
        tracked_peak=tracked,
        phase=phase,
        breakdown=parts,
        micro_batch=size,
        amp=amp,
        checkpointing=checkpointing,
        exact=reason is None,
        reason=reason,
        seconds=time.perf_counter() - started,
    )


def _traced(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Any,
    device: torch.device,
    watch: Callable[[torch.Tensor], None],
    step: Callable[[nn.Module, Any], torch.Tensor],
    *settings: Any,
) -> tuple[int, int, str, dict[str, int], str | None]:
    """The trace, made and run here so that nothing of it outlives this call: the Guard then finds
    alive only what the script kept."""
    trace = _Trace(model, optimizer, batch, device, watch)
    return (*trace.run(step, *settings), trace.exact_reason)


def estimate(
    measured: dict[str, int],
    measured_micro_batch: int,
    measured_amp: str,
    measured_checkpointing: bool,
    *,
    micro_batch: int,
    amp: str,
    checkpointing: bool,
    blocks: int,
    reason: str,
) -> Prediction:
    """The fallback: a measured step's breakdown (PARTS; peak = their sum) scaled to other settings.

    Activations and temporaries scale with the micro-batch, halve under AMP and, with checkpointing,
    keep about one block's worth in `blocks`. Parameters, gradients and optimizer state stay. Rough by
    design (off by up to half in the study), and labelled so with `reason`.
    """
    scale = micro_batch / max(measured_micro_batch, 1)
    scale *= _amp_factor(amp) / _amp_factor(measured_amp)
    if checkpointing != measured_checkpointing and blocks > 1:
        scale *= (1 / blocks) if checkpointing else blocks
    fixed = sum(measured.get(k, 0) for k in ("parameters", "gradients", "optimizer"))
    moving = {k: int(measured.get(k, 0) * scale) for k in ("activations", "temporaries")}
    parts = {k: measured.get(k, 0) for k in ("parameters", "gradients", "optimizer")} | moving
    peak = fixed + sum(moving.values())
    return Prediction(
        peak=peak,
        tracked_peak=fixed + moving["activations"],
        phase="backward",
        breakdown=parts,
        micro_batch=micro_batch,
        amp=amp,
        checkpointing=checkpointing,
        exact=False,
        reason=reason,
    )


def _amp_factor(mode: str) -> float:
    return 1.0 if mode == "off" else 0.5


def _device(model: nn.Module, device: str | torch.device | None) -> torch.device:
    """Where the step runs, with its index: "cuda" is the current GPU (tensors report cuda:N)."""
    found = torch.device(device) if device is not None else next((p.device for p in model.parameters()), None)
    if found is None:
        return torch.device("cpu")
    if found.type == "cuda" and not torch.backends.cuda.is_built():  # fake CUDA tensors would abort the process
        raise Untraceable("this torch has no CUDA: fake CUDA tensors cannot be made")
    if found.type == "cuda" and found.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return found


class _Restored:
    """Every generator a trace could draw from, put back after it: fake ops draw nothing, but the
    script's step() may draw from Python's `random` or NumPy's global generator itself."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __enter__(self) -> None:
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state(self.device) if self._cuda() else None
        self.python = random.getstate()
        numpy_random = sys.modules.get("numpy.random")
        self.numpy = (numpy_random, numpy_random.get_state()) if numpy_random is not None else None

    def _cuda(self) -> bool:
        return self.device.type == "cuda" and torch.cuda.is_initialized()

    def __exit__(self, *exc: object) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, self.device)
        random.setstate(self.python)
        if self.numpy is not None:
            module, state = self.numpy
            module.set_state(state)


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class _Counter(TorchDispatchMode):
    """Live storage bytes on one device, op by op; the peak, its phase and its parts."""

    def __init__(self, device: torch.device, watch: Callable[[torch.Tensor], None]) -> None:
        super().__init__()
        self.device = device
        self.watch = watch  # each tensor seen (the Guard's)
        self.block = CUDA_BLOCK if device.type == "cuda" else 1
        self.live: dict[int, int] = {}
        self.total = 0
        self.phase = "forward"
        self.peak = 0
        self.peak_phase = "forward"
        self.peak_parts: dict[str, int] = {}
        self.fixed = 0  # parameters and buffers
        self.gradients = 0
        self.grads_seen: set[int] = set()  # parameters whose gradient this step is counted
        self.saved: dict[int, int] = {}  # storages autograd keeps for backward, alive
        self.saved_bytes = 0
        self.optimizer_bytes: Callable[[], int] = lambda: 0
        self.note_inputs: Callable[[tuple[Any, ...]], object] | None = None  # a checkpointed block's inputs
        self.fake: Callable[[torch.Tensor], torch.Tensor] | None = None  # the trace's fake of a real tensor
        self.fake_type: type = torch.Tensor
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
        key = storage._cdata
        if key in self.live:
            return
        size = -(-storage.nbytes() // self.block) * self.block
        self.live[key] = size
        self.total += size
        self.holds.append(weakref.finalize(storage, self._free, key))
        if self.total > self.peak:
            self._new_peak()

    def _free(self, key: int) -> None:
        self.total -= self.live.pop(key, 0)
        self.saved_bytes -= self.saved.pop(key, 0)

    def _new_peak(self) -> None:
        self.peak, self.peak_phase = self.total, self.phase
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
        key = _key(t)
        if key in self.saved or key not in self.live:
            return 0
        self.saved[key] = self.live[key]
        self.saved_bytes += self.live[key]
        return self.live[key]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default and not _constant(args[0]):
            # A fake tensor has no value (a constant, like an optimizer's step count, has): a step that
            # logs its loss, or checks it, gets 1 (true) and the prediction says it was approximate (a
            # branch on the value may have gone the other way).
            self.values_read += 1
            return _stand_in(args[0].dtype)
        if self.fake is not None and func not in _LIFTS:  # the fake mode makes torch.tensor(...) a constant
            args, kwargs = pytree.tree_map_only(torch.Tensor, self._faked, (args, kwargs or {}))
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.add(t)
        return out

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
        assert self.fake is not None
        return self.fake(t)


_LIFTS = (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default)


def _unhooked_step(optimizer: torch.optim.Optimizer) -> None:
    """The optimizer class's own step, without the hooks torch wraps around it (the script's own and the
    global ones would see a step that never happened) and without an LR scheduler's instance wrapper."""
    step: Any = type(optimizer).step
    if getattr(step, "hooked", False):  # Optimizer._patch_step_function's wrapper
        step = step.__wrapped__
    step(optimizer)


def _constant(t: torch.Tensor) -> bool:
    return getattr(t, "constant", None) is not None


def _stand_in(dtype: torch.dtype) -> bool | int | float:
    if dtype is torch.bool:
        return True
    return 1.0 if dtype.is_floating_point or dtype.is_complex else 1


class _Trace:
    """The fake copy of one run (model, optimizer, batch) and one step traced on it."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        batch: Any,
        device: torch.device,
        watch: Callable[[torch.Tensor], None],
    ) -> None:
        self.exact_reason: str | None = None
        self.device = device
        self.watch = watch  # each fake made: the Guard looks for those the script kept
        self.wrapped: list[nn.Module] = []  # the copy's blocks checkpointed: unwrapped after the run
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module  # one rank's step: its buckets are outside the trace (the correction has them)
        if type(model).__name__ == "OptimizedModule":  # torch.compile's: the eager model (compiled may hold less)
            model = model._orig_mod  # type: ignore[assignment]
            self.exact_reason = "compiled model traced eagerly"
        if any(type(p) is not nn.Parameter and type(p) is not torch.Tensor for p in model.parameters()):
            raise Untraceable("sharded parameters (FSDP): each rank's step cannot be traced alone")
        # Only now: making fake tensors imports torch._dynamo and torch._inductor (a second, and their exit
        # handlers), which a run that cannot be traced should not pay.
        from torch._subclasses.fake_tensor import FakeTensorMode

        self.mode = FakeTensorMode(allow_non_fake_inputs=False)
        self.fakes: dict[int, torch.Tensor] = {}
        self._kept: list[torch.Tensor] = []
        memo: dict[int, Any] = {}
        for module in model.modules():
            for name, value in vars(module).items():  # tensors kept as plain attributes (masks, caches)
                if name in ("_parameters", "_buffers"):
                    continue
                for t in _held(value):
                    if isinstance(t, torch.Tensor):
                        memo[id(t)] = self._fake(t)
            for p in module._parameters.values():
                if p is not None and id(p) not in memo:
                    fake = self._fake(p)
                    fake.requires_grad_(p.requires_grad)
                    memo[id(p)] = fake
            for b in module._buffers.values():
                if b is not None and id(b) not in memo:
                    memo[id(b)] = self._fake(b)
        try:
            self.model: nn.Module = copy.deepcopy(model, memo)
        except Exception as exc:
            raise Untraceable(f"the model cannot be copied: {line(exc)}") from exc
        self.copies = memo  # id(real module) -> its copy, among the rest
        _strip_wrappers(self.model)
        self.optimizer = self._optimizer(optimizer)
        self.batch = map_tensors(batch, self._fake)

    def _fake(self, t: torch.Tensor, constant: bool = False) -> torch.Tensor:
        """`t`'s fake, made once (by id: `t` is kept alive until the trace ends, so no id is reused).
        Also called from inside the trace's dispatch, where the modes must not see the conversion."""
        key = id(t)
        if key not in self.fakes:
            with _disable_current_modes():
                if constant:
                    converter = self.mode.fake_tensor_converter
                    fake = converter.from_real_tensor(self.mode, t.detach().clone(), make_constant=True)
                else:
                    fake = self.mode.from_tensor(t.detach())
            self.fakes[key] = fake
            self._kept.append(t)
            self.watch(fake)
        return self.fakes[key]

    def _optimizer(self, real: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """`real` rebuilt over the fake parameters: same class, groups and options, state as fakes
        (scalars as constants, so an optimizer reading `step` as a number still can), and foreach/fused
        as torch would choose on the real device (it never picks them for a tensor subclass)."""
        fake = object.__new__(type(real))
        fake.__dict__.update(real.__dict__)
        fake.__dict__.pop("step", None)  # an LR scheduler's wrapper of the real optimizer's step
        fake._optimizer_step_pre_hooks, fake._optimizer_step_post_hooks = {}, {}  # the script's run on its real steps
        groups = []
        for group in real.param_groups:
            params = [p for p in group["params"]]
            copied = {k: (self._fake(v, constant=True) if isinstance(v, torch.Tensor) else v) for k, v in group.items()}
            copied["params"] = [self._fake_param(p) for p in params]
            if copied.get("foreach") is None and not copied.get("fused") and "foreach" in real.defaults:
                fused, foreach = _default_kernels(params)
                copied["foreach"] = foreach and not fused
            groups.append(copied)
        fake.param_groups = groups
        state: dict[Any, Any] = {}
        for p, entries in real.state.items():
            if isinstance(p, torch.Tensor) and id(p) in self.fakes:
                state[self.fakes[id(p)]] = {
                    k: (self._fake(v, constant=v.numel() <= 1) if isinstance(v, torch.Tensor) else copy.copy(v))
                    for k, v in entries.items()
                }
        from collections import defaultdict

        fake.state = defaultdict(dict, state)
        return fake

    def _fake_param(self, p: torch.Tensor) -> torch.Tensor:
        """The model's fake of `p`; a parameter the optimizer holds beyond the model gets its own."""
        if id(p) not in self.fakes:
            self._fake(p).requires_grad_(p.requires_grad)
        return self.fakes[id(p)]

    def run(
        self,
        step: Callable[[nn.Module, Any], torch.Tensor],
        size: int,
        total: int,
        amp: str,
        checkpointing: bool,
        checkpoint_modules: Sequence[nn.Module] | None,
        min_micro_batch: int,
    ) -> tuple[int, int, str, dict[str, int]]:
        from torch._subclasses.fake_tensor import FakeTensor

        counter = _Counter(self.device, self.watch)
        counter.fake, counter.fake_type = self._fake, FakeTensor
        model, optimizer = self.model, self.optimizer
        params = list(model.parameters())
        tracked_params = sum(_storage_bytes(params).values())
        self._checkpointing(checkpointing, checkpoint_modules, counter)
        cut = sizes(total, size, min_micro_batch)
        tracked_peak = 0
        with self.mode, counter, self._unwrapping():
            for t in [*params, *model.buffers(), *state_tensors(optimizer), *tensors(self.batch)]:
                if isinstance(t, torch.Tensor):
                    counter.add(t)
            counter.fixed = counter.total - sum(_storage_bytes(state_tensors(optimizer)).values())
            counter.fixed -= sum(_storage_bytes(_on(self.device, tensors(self.batch))).values())
            counter.optimizer_bytes = lambda: sum(_storage_bytes(state_tensors(optimizer)).values())
            for p in params:
                if p.requires_grad:
                    counter.holds.append(
                        p.register_post_accumulate_grad_hook(functools.partial(_grad_arrived, counter))
                    )
            tracked_optimizer = counter.optimizer_bytes()
            # Before the optimizer's first step its state is made at the step's end; from the second step
            # on it is held throughout, which is the peak a run has to fit: both steps are traced then.
            for _ in range(1 if optimizer.state else 2):
                tracked_peak, tracked_optimizer = self._step(
                    step,
                    counter,
                    size,
                    total,
                    cut,
                    amp,
                    min_micro_batch,
                    tracked_params,
                    tracked_optimizer,
                    tracked_peak,
                )
        if counter.values_read:
            read = f"the step read {counter.values_read} tensor value(s) (.item(), bool()): traced as if each were 1"
            self.exact_reason = "; ".join(filter(None, (self.exact_reason, read)))
        return counter.peak, tracked_peak, counter.peak_phase, counter.peak_parts

    def _step(
        self,
        step: Callable[[nn.Module, Any], torch.Tensor],
        counter: _Counter,
        size: int,
        total: int,
        cut: list[int],
        amp: str,
        min_micro_batch: int,
        tracked_params: int,
        tracked_optimizer: int,
        tracked_peak: int,
    ) -> tuple[int, int]:
        """One step as fit runs it (strategies/single.py); the tracker's count at its worst and after it."""
        model, optimizer = self.model, self.optimizer
        params = list(model.parameters())
        param_keys = {_key(p) for p in params}
        batch_keys = {_key(t) for t in tensors(self.batch)}
        count = len(cut)
        counter.gradients, counter.grads_seen = 0, set()
        pieces = split(self.batch, size, total, min_micro_batch)
        # Every piece after the first holds what the largest of them holds (the gradients are there
        # already): two are traced, whatever the accumulation.
        traced = [0] if count == 1 else [0, max(range(1, count), key=cut.__getitem__)]
        grads = 0
        for i in traced:
            piece, share = pieces[i], cut[i] / total
            counter.phase = "forward"
            saved: dict[int, int] = {}

            def pack(t: torch.Tensor, saved: dict[int, int] = saved) -> torch.Tensor:
                key = _key(t)
                if key not in param_keys and key not in saved:
                    counter.mark_saved(t)  # not a parameter's storage: those are counted as parameters
                    if key not in batch_keys:  # the tracker's count: the batch's storages were there before the step
                        saved[key] = t.untyped_storage().nbytes()
                return t.detach()  # as the tracker's pack: an output saved by its own grad_fn makes no cycle

            counter.note_inputs = lambda args, pack=pack: [pack(a) for a in args if isinstance(a, torch.Tensor)]
            with torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
                piece = to_device(piece, self.device)
                with _autocast(self.device, amp):
                    loss = step(model, piece)
            if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
                raise Untraceable("step() did not return a loss that requires grad")
            counter.phase = "backward"
            (loss * share if count > 1 else loss).backward()
            grads = sum(g.numel() * g.element_size() for p in params if (g := p.grad) is not None)
            tracked_peak = max(tracked_peak, tracked_params + grads + tracked_optimizer + sum(saved.values()))
            del loss, piece
            counter.note_inputs = None
        del pieces
        counter.phase = "optimizer"
        _unhooked_step(optimizer)
        tracked_optimizer = sum(_storage_bytes(state_tensors(optimizer)).values())
        tracked_peak = max(tracked_peak, tracked_params + grads + tracked_optimizer)
        for p in params:
            p.grad = None  # fit's zero_grad(set_to_none=True)
        return tracked_peak, tracked_optimizer

    def _checkpointing(self, on: bool, modules: Sequence[nn.Module] | None, counter: _Counter) -> None:
        """Checkpointing on the copy as fit would switch it, without the process RNG saved and restored
        (`preserve_rng_state=False`: the copy's dropout draws nothing real)."""
        hf = find_hugging_face(self.model) if modules is None else None
        ckpt = functools.partial(checkpoint, use_reentrant=False, preserve_rng_state=False)
        if hf is not None:
            for layer in hf.modules():
                if hasattr(layer, "gradient_checkpointing"):
                    vars(layer)["gradient_checkpointing"] = on  # plain attributes (nn.Module types them as tensors)
                    if on:
                        vars(layer)["_gradient_checkpointing_func"] = ckpt
            return
        if not on:
            return
        blocks = [self.copies[id(m)] for m in modules] if modules is not None else find_blocks(self.model)
        if not blocks:
            raise Untraceable("checkpointing: no repeated blocks found")
        for block in blocks:
            original = block.forward

            def forward(*args: Any, original: Any = original, **kwargs: Any) -> Any:
                if not torch.is_grad_enabled():
                    return original(*args, **kwargs)
                if counter.note_inputs is not None:
                    counter.note_inputs(args)  # kept alive for the recompute: the tracker counts them
                return ckpt(original, *args, **kwargs)

            block.forward = forward
            self.wrapped.append(block)

    @contextlib.contextmanager
    def _unwrapping(self) -> Iterator[None]:
        """The checkpointed blocks' wrappers gone after the run: each refers to its block (a cycle that would
        keep the copy alive until a garbage collection)."""
        try:
            yield
        finally:
            for block in self.wrapped:
                del block.forward


def _held(value: Any) -> Iterable[Any]:
    """What a module attribute holds: the items of a list, tuple or dict, or the value itself."""
    if isinstance(value, dict):
        return value.values()
    return value if isinstance(value, (list, tuple)) else (value,)


def _grad_arrived(counter: _Counter, p: torch.Tensor) -> None:
    if id(p) not in counter.grads_seen and p.grad is not None:
        counter.grads_seen.add(id(p))
        counter.gradients += p.grad.numel() * p.grad.element_size()


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


def _storage_bytes(tensors: Iterable[torch.Tensor]) -> dict[int, int]:
    return {_key(t): t.untyped_storage().nbytes() for t in tensors}


def _on(device: torch.device, items: Iterable[Any]) -> list[torch.Tensor]:
    return [t for t in items if isinstance(t, torch.Tensor) and t.device == device]


def _autocast(device: torch.device, amp: str) -> Any:
    if amp == "off":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=AMP_DTYPES[amp])


def _strip_wrappers(model: nn.Module) -> None:
    """The copy's blocks without fit's checkpointing wrappers (each calls the real block it was made for)."""
    for module in model.modules():
        forward = vars(module).get("forward")
        if forward is not None and getattr(forward, "gputui_checkpointing", False):
            del module.forward


def _why(exc: Exception) -> str:
    """Why a step could not run on fake tensors, in a line a user can act on."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

    if isinstance(exc, DataDependentOutputException):
        return f"the step reads a value from its data (.item(), a Python bool of a tensor): {line(exc)}"
    if isinstance(exc, DynamicOutputShapeException):
        return f"a shape in the step depends on the data (nonzero, masked_select, unique): {line(exc)}"
    return f"the step cannot run on fake tensors: {line(exc)}"


def _default_kernels(params: list[torch.Tensor]) -> tuple[bool, bool]:
    from torch.optim.optimizer import _default_to_fused_or_foreach

    fused, foreach = _default_to_fused_or_foreach(params, differentiable=False, use_fused=False)
    return bool(fused), bool(foreach)


def line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


__all__ = ["PARTS", "Prediction", "Unsafe", "Untraceable", "estimate", "line", "predict"]
