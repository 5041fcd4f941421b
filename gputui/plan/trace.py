"""What one training step would hold at its peak, traced on fake tensors before anything is allocated.

`predict()` runs the step fit() would run on a fake copy of the model and optimizer (fake.py): the
global batch cut by the run's Sizing, its pieces forward and backward through run_pieces (the micro-batch
loop fit runs), under the same autocast and the same Checkpointing, then the optimizer's step. A dispatch
mode (counter.py) keeps the bytes of the live storages, so the peak, its phase and what was alive then
come out of the same ops the real step would run. Extrapolating from a measured step instead is off by
2-49 % and can get the direction wrong (a model whose peak is in the optimizer step gains nothing from
AMP, and halving its micro-batch raises its peak).

Nothing of the real run is touched: the copy shares no tensor with the model, checkpointing on the copy
does not save and restore the process's RNG, and the step's own code, which runs for real, is guarded
(guard.py: what it changed put back, the tensors it kept taken out). Nothing of the copy outlives the
call. Where a step cannot be traced (a shape that depends on data, `.item()` deciding control flow, a
model that cannot be copied), `estimate()` scales a measured step instead and says so.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..probes.cpu import state_tensors
from ..step.checkpointing import Checkpointing
from ..step.microbatch import batch_size, tensors, to_device
from ..step.pieces import run_pieces
from ..step.precision import autocast
from ..step.sizing import Sizing
from . import private
from .counter import Counter, storage_bytes
from .fake import FakeCopy
from .guard import Guard
from .prediction import Prediction, Untraceable, line


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
    with Guard(step, model, target) as guard:
        try:
            peak, tracked, phase, parts, reason = _traced(
                model, optimizer, batch, guard.watch, step, target, Sizing(min_micro_batch), size, total, amp,
                checkpointing, checkpoint_modules,
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
    watch: Callable[[torch.Tensor], None],
    step: Callable[[nn.Module, Any], torch.Tensor],
    device: torch.device,
    sizing: Sizing,
    *settings: Any,
) -> tuple[int, int, str, dict[str, int], str | None]:
    """The trace, made and run here so that nothing of it outlives this call: the Guard then finds
    alive only what the script kept."""
    mode = private.fake_tensor_mode()
    try:
        return _Trace(FakeCopy(model, optimizer, batch, watch, mode), step, device, sizing).run(*settings)
    finally:
        private.forget_reals(mode)  # also after a copy that failed half-made


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


@dataclass
class _Tracked:
    """The step as gputui's CPU tracker counts it (probes/cpu.StateTracker): parameters, gradients,
    optimizer state and the activations saved for backward, at its worst."""

    params: int
    optimizer: int
    grads: int = 0
    peak: int = 0


class _Trace:
    """One step traced on a fake copy, as fit runs it on one process (strategies/single.py). What a piece
    needs is kept here, not in closures: a closure that an exception's traceback reaches keeps what it
    holds (the copy) alive after its frame is cleared, a method's frame does not."""

    def __init__(self, copy: FakeCopy, step: Callable[[nn.Module, Any], torch.Tensor], device: torch.device,
                 sizing: Sizing) -> None:  # fmt: skip
        self.copy, self.step, self.device, self.sizing = copy, step, device, sizing
        self.counter = Counter(device, copy.watch, copy.fake, copy.fake_type)
        self.params = list(copy.model.parameters())
        self.param_keys = {private.storage_key(p.untyped_storage()) for p in self.params}
        self.batch_keys = {private.storage_key(t.untyped_storage()) for t in tensors(copy.batch)}
        self.amp = "off"
        self.saved: dict[int, int] = {}  # a piece's storages saved for backward, as the tracker counts them
        self.tracked = _Tracked(sum(storage_bytes(self.params).values()), 0)

    def run(
        self, size: int, total: int, amp: str, checkpointing: bool, modules: Sequence[nn.Module] | None
    ) -> tuple[int, int, str, dict[str, int], str | None]:
        counter, model, optimizer, batch = self.counter, self.copy.model, self.copy.optimizer, self.copy.batch
        self.amp = amp
        blocks = None if modules is None else [self.copy.copies[id(m)] for m in modules]
        # The copy's dropout draws nothing real, and its devices need not be initialized: no RNG kept.
        switch = Checkpointing(model, blocks, preserve_rng_state=False)
        reason = switch.unavailable()
        if checkpointing and reason:
            raise Untraceable(f"checkpointing: {reason}")
        switch.force(checkpointing)
        switch.on_inputs = self._inputs_kept
        try:
            with self.copy.mode, counter:
                for t in [*self.params, *model.buffers(), *state_tensors(optimizer), *tensors(batch)]:
                    if isinstance(t, torch.Tensor):
                        counter.add(t)
                counter.optimizer = optimizer
                on_device = _on(self.device, tensors(batch))
                counter.fixed = counter.total - counter.optimizer_bytes() - counter.held(on_device)
                for p in self.params:
                    if p.requires_grad:
                        counter.holds.append(p.register_post_accumulate_grad_hook(counter.grad_arrived))
                self.tracked.optimizer = _state_bytes(optimizer)
                # Before the optimizer's first step its state is made at the step's end; from the second step
                # on it is held throughout, which is the peak a run has to fit: both steps are traced then.
                for _ in range(1 if optimizer.state else 2):
                    self._step(size, total)
        finally:
            switch.remove()  # each wrapper refers to its block: a cycle that would keep the copy until a collection
        exact_reason = self.copy.exact_reason
        if counter.values_read:
            read = f"the step read {counter.values_read} tensor value(s) (.item(), bool()): traced as if each were 1"
            exact_reason = "; ".join(filter(None, (exact_reason, read)))
        return counter.peak, self.tracked.peak, counter.peak_phase, counter.peak_parts, exact_reason

    def _step(self, size: int, total: int) -> None:
        """One step: two of its pieces forward and backward, then the optimizer's step."""
        counter, tracked = self.counter, self.tracked
        counter.gradients, counter.grads_seen = 0, set()
        cut = self.sizing.cut(total, size)
        pieces = self.sizing.split(self.copy.batch, size, total)
        # Every piece after the first holds what the largest of them holds (the gradients are there
        # already): two are traced, whatever the accumulation.
        traced = [0] if len(cut) == 1 else [0, max(range(1, len(cut)), key=cut.__getitem__)]
        run_pieces(
            [pieces[i] for i in traced],
            [cut[i] for i in traced],
            total,
            self._forward,
            torch.Tensor.backward,
            functools.partial(_share, total=total),
            after=self._piece_done,
            at=counter.at,
        )
        counter.at.phase = "optimizer"
        private.unhooked_step(self.copy.optimizer)
        tracked.optimizer = _state_bytes(self.copy.optimizer)
        tracked.peak = max(tracked.peak, tracked.params + tracked.grads + tracked.optimizer)
        for p in self.params:
            p.grad = None  # fit's zero_grad(set_to_none=True)

    def _forward(self, piece: Any) -> torch.Tensor:
        """A piece's loss, as Runner.forward makes it; what it saves for backward counted."""
        self.saved.clear()
        piece = to_device(piece, self.device)
        with autocast(self.device, self.amp), torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
            loss = self.step(self.copy.model, piece)
        if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
            raise Untraceable("step() did not return a loss that requires grad")
        return loss

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key = private.storage_key(t.untyped_storage())
        if key not in self.param_keys and key not in self.saved:
            self.counter.mark_saved(t)  # not a parameter's storage: those are counted as parameters
            if key not in self.batch_keys:  # the tracker's count: the batch's storages were there before the step
                self.saved[key] = t.untyped_storage().nbytes()
        return t.detach()  # as the tracker's pack: an output saved by its own grad_fn makes no cycle

    def _inputs_kept(self, args: tuple[Any, ...]) -> None:
        """A checkpointed block's inputs stay alive for the recompute: the tracker counts them."""
        for a in args:
            if isinstance(a, torch.Tensor):
                self._pack(a)

    def _piece_done(self) -> None:
        tracked = self.tracked
        tracked.grads = sum(g.numel() * g.element_size() for p in self.params if (g := p.grad) is not None)
        tracked.peak = max(tracked.peak, tracked.params + tracked.grads + tracked.optimizer + sum(self.saved.values()))


def _share(n: int, total: int) -> float:
    """A piece's weight: its share of the global batch's samples."""
    return n / total


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(storage_bytes(state_tensors(optimizer)).values())


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


def _on(device: torch.device, items: Iterable[Any]) -> list[torch.Tensor]:
    return [t for t in items if isinstance(t, torch.Tensor) and t.device == device]


def _why(exc: Exception) -> str:
    """Why a step could not run on fake tensors, in a line a user can act on."""
    wanted = private.data_dependent(exc)
    if wanted == "value":
        return f"the step reads a value from its data (.item(), a Python bool of a tensor): {line(exc)}"
    if wanted == "shape":
        return f"a shape in the step depends on the data (nonzero, masked_select, unique): {line(exc)}"
    return f"the step cannot run on fake tensors: {line(exc)}"
