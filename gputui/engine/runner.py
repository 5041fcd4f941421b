"""What every strategy runs a global batch with: the cut into pieces and their weights, a piece's
forward (on the device, under autocast, its saved tensors counted), the backward through the
scaler, the gradient norm and its clipping, the optimizer step, and the bookkeeping once a step is done."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from contextlib import nullcontext
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.nn.utils import clip_grads_with_norm_, get_total_norm

from ..probes.cpu import StateTracker
from ..step.checkpointing import Checkpointing
from ..step.microbatch import shapes, tensors, to_device, token_weighted
from ..step.pieces import Progress, run_pieces
from ..step.precision import Precision, unfused_fix
from .deferred import DeferredLoss
from .oom import Buffers
from .result import FitError
from .session import RunSession
from .state import RunState


def count(items: Callable[[Any], Any], batch: Any) -> int:
    """items(batch) as a count: an int, or a tensor of one integral value (read on the host batch).
    Training weighs its pieces with it, evaluate() too."""
    return as_count(items(batch))


def as_count(n: Any) -> int:
    """What items() returned, checked to be a count."""
    try:
        value = float(n)  # an int, a NumPy integer, a one-element tensor
    except (TypeError, ValueError, RuntimeError):
        value = math.nan
    if isinstance(n, bool) or not (value >= 0 and value.is_integer()):
        shown = f"a tensor of shape {tuple(n.shape)}" if isinstance(n, torch.Tensor) else repr(n)[:80]
        raise FitError(f"items(batch) must return a count (an int >= 0, or a one-element tensor), got {shown}")
    return int(value)


def _holder(param: torch.Tensor) -> torch.Tensor | None:
    """A view of `param` whose graph holds its AccumulateGrad node, or None for a tensor subclass that will
    not make one: holding it is a saving, never a need. A view, not the node itself: a node with a Python
    object costs every graph that reaches it a Python reference taken, with the GIL, inside backward."""
    try:
        view = param.view_as(param)
        return view if view.requires_grad else None  # a view of a leaf that requires grad: its node's edge
    except Exception:
        return None


class Runner:
    def __init__(
        self,
        model: nn.Module,
        step: Callable[[nn.Module, Any], torch.Tensor],
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        items: Callable[[Any], Any] | None,
        device: torch.device,
        precision: Precision,
        checkpointing: Checkpointing,
        buffers: Buffers,
        session: RunSession,
        state: RunState,
    ) -> None:
        self.model, self.step, self.optimizer, self.scheduler, self.items = model, step, optimizer, scheduler, items
        self.norm: torch.Tensor | None = None  # the step's gradient norm, from the optimizer step to done()
        self.device, self.precision, self.checkpointing = device, precision, checkpointing
        self.session, self.state = session, state
        self.tracker: StateTracker | None = session.tracker
        self.probe = session.probe
        self.batch_norms = buffers.batch_norms
        self.losses = DeferredLoss.for_device(device)
        self.loss: torch.Tensor | None = None  # the last step's, detached: read by whoever wants it (a sync)
        self.grad_norm: torch.Tensor | None = None
        self._accumulators: list[torch.Tensor] = []  # see hold_accumulators()
        self._said_batch_norm = not buffers.batch_norms  # said once, or nothing to say
        self._said_items = items is not None  # the token-mean hint: said once, or not needed
        self._count_whole = True  # items() of a batch trained whole is read (a host count)
        self._said_fused = False  # the fp16 scaler's wait for the GPU: said once a run

    # -- the run ----------------------------------------------------------------------------
    def hold_accumulators(self) -> None:
        """Keep every trainable parameter's AccumulateGrad node for the run. A step's graph is freed
        right after its backward (what a custom Function keeps on its ctx goes before the optimizer
        allocates); its accumulators went with it, and a 1.4 ms CPU step was then ~8 us slower in its
        optimizer step (measured against a plain loop, whose graph lives until the next forward). Held
        here (as long as the runner holds the model), the free costs that step nothing more. DDP's
        reducer holds them itself."""
        with torch.enable_grad():
            held = [_holder(p) for p in self.model.parameters() if p.requires_grad]
        self._accumulators = [v for v in held if v is not None]

    # -- a try at a global batch ------------------------------------------------------------
    def start(self, batch: Any, size: int) -> None:
        """A try begins at micro-batch `size`: what it saves for backward depends on these alone."""
        tracker = self.tracker
        if tracker is not None:
            self.state.shapes = shapes(batch)
            key = (size, self.precision.mode, self.checkpointing.enabled, self.state.shapes)
            tracker.start_step(key, lambda: tensors(batch))
        start = self.probe.start_step
        if start is not None:
            start()

    def cut(self, batch: Any, size: int) -> list[Any]:
        """The batch's pieces at `size` (views); the first cut of a run says what cutting changes."""
        pieces = self.state.sizing.split(batch, size, self.state.batch_size)
        if len(pieces) > 1:
            self._say_split(batch, size)
        return pieces

    def counts(self, pieces: list[Any], size: int) -> tuple[list[int], int]:
        """Each piece's weight units and their sum: its samples, or with `items` what its loss is a mean
        over (so the pieces' weighted losses add up to the global batch's mean, whatever the padding)."""
        if self.items is None:
            counts = self.state.sizing.cut(self.state.batch_size, size)
        else:
            counts = [self.count(piece) for piece in pieces]
        return counts, sum(counts)

    def count(self, batch: Any) -> int:
        assert self.items is not None
        return count(self.items, batch)

    def none_counted(self, batch: Any) -> bool:
        """Whether `items` counts nothing in a batch trained whole (its loss a mean over nothing: NaN, which
        would train into every weight). Read only where it costs no wait for the device: a count
        that is a device tensor is left unread (a sync a step), as a batch cut into pieces reads it."""
        if self.items is None or not self._count_whole:
            return False
        n = self.items(batch)
        if isinstance(n, torch.Tensor) and n.device.type != "cpu":
            self._count_whole = False  # the data comes on the device: not asked again (a kernel a step)
            return False
        return as_count(n) == 0

    def units(self, batch: Any) -> int:
        """The whole batch's items (its samples without `items`)."""
        return self.count(batch) if self.items is not None else self.state.batch_size

    # -- a piece ----------------------------------------------------------------------------
    def forward(self, piece: Any) -> torch.Tensor:
        """One micro-batch's loss: on the device, under AMP, what it saves for backward counted."""
        piece = to_device(piece, self.device)
        tracker = self.tracker
        if self.precision.mode == "off" and (tracker is None or not tracker.counting):
            loss = self.step(self.model, piece)  # most steps: no context to enter and leave
        else:
            with self.precision.autocast(), tracker.saving() if tracker is not None else nullcontext():
                loss = self.step(self.model, piece)
        if not (isinstance(loss, torch.Tensor) and loss.requires_grad and loss.numel() == 1):
            self._check_loss(loss)  # says what is wrong
        return loss

    def backward(self, loss: torch.Tensor) -> None:
        scaler = self.precision.scaler
        (scaler.scale(loss) if scaler is not None else loss).backward()

    def run(
        self,
        pieces: list[Any],
        counts: list[int],
        units: int,
        weight: Callable[[int], float],
        at: Progress,
        **how: Any,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The pieces through step/pieces.py's one loop with this run's forward and backward (`how`:
        the strategy's sync, skip_empty, hold_last)."""
        return run_pieces(
            pieces, counts, units, self.forward, self.backward, weight, after=self.piece_done, at=at, **how
        )

    def piece_done(self) -> None:
        tracker = self.tracker
        if tracker is not None and tracker.counting:
            tracker.end_micro_batch()

    # -- the step's end ---------------------------------------------------------------------
    def optimizer_step(self) -> None:
        """Once a step, after its last backward (under torchrun, after the gradients were reduced)."""
        self.norm = None
        scaler = self.precision.scaler
        if scaler is not None:
            if not self._said_fused:
                self._say_fused()
            scaler.unscale_(self.optimizer)  # the norm and the clip are the true gradients' (step() will not again)
        if scaler is not None or self.state.clip_grad_norm is not None:
            self.norm = self.clip_norm()
        if scaler is not None:
            scaler.step(self.optimizer)
            scaler.update()
        else:
            self.optimizer.step()
        if self.tracker is not None:
            self.tracker.refresh_optimizer()

    def abandon_optimizer_step(self) -> None:
        """After an error inside the optimizer step: a GradScaler that unscaled this step's gradients would
        refuse the next step's unscale_(); its update() closes the step (as one it skipped)."""
        scaler = self.precision.scaler
        if scaler is not None:
            with contextlib.suppress(RuntimeError):  # nothing unscaled yet: nothing to close
                scaler.update()

    def clip_norm(self) -> torch.Tensor:
        """The whole model's gradient norm (a tensor: read later, without waiting for the device), the
        gradients scaled down to fit's `clip_grad_norm` when it is larger. Measured when clipping, and
        under fp16 (its skipped steps are those whose norm is not finite); else not at all: a read of every
        gradient costs a tiny CPU model's step 5 % (about 50 us of 1 ms). Under FSDP2 the gradients are
        shards (DTensors): their norm comes combined over the ranks, a DTensor made a plain tensor here. A
        step the GradScaler skips has an inf or nan norm: clipping makes its gradients nan, unused."""
        params = list(self.model.parameters())
        norm = get_total_norm([g for p in params if (g := p.grad) is not None])
        full = getattr(norm, "full_tensor", None)
        if full is not None:
            norm = full()
        clip = self.state.clip_grad_norm
        if clip is not None and clip != math.inf:  # inf: the norm measured, the gradients as they are
            clip_grads_with_norm_(params, clip, norm)
        return norm

    def done(self, loss_sum: torch.Tensor, pieces: int) -> None:
        """After optimizer.step(): the gradients and counted bytes go, the schedule and counters move."""
        self.optimizer.zero_grad(set_to_none=True)
        tracker = self.tracker
        if tracker is not None and tracker.counting:  # a step not counted changed no count: no call
            tracker.reset()
        if self.scheduler is not None:
            self.scheduler.step()
        state = self.state
        self.loss = loss_sum
        state.loss = self.losses.put(loss_sum)  # no wait for the device (engine/deferred.py)
        state.accumulation = pieces
        session = self.session
        session.steps += 1
        session.samples += state.batch_size
        norm, self.norm = self.norm, None
        self.grad_norm = norm  # the step's, a tensor: read by whoever wants it (gputui.Trainer's result)
        if norm is not None:
            skips = partial(self._skipped, session.steps) if self.precision.scaler is not None else None
            state.grad_norm = state.grad_norms.put(norm, skips)

    def _skipped(self, step: int, norm: float) -> None:
        """Step `step`'s norm, read: not finite under fp16 means the GradScaler found an inf or nan among
        the gradients it unscaled (the same ones, the optimizer's being the model's) and skipped the step."""
        if not math.isfinite(norm):
            self.state.skipped_steps += 1
            self.session.emit("step_skipped", at=step, skipped=self.state.skipped_steps)

    def _check_loss(self, loss: Any) -> None:
        if not isinstance(loss, torch.Tensor):
            raise FitError(f"step() must return the loss as a scalar tensor, got {type(loss).__name__}")
        if loss.numel() != 1:
            raise FitError(
                f"step() must return a scalar loss (the mean over the batch), got a tensor of shape "
                f"{tuple(loss.shape)}: reduce it with .mean()"
            )
        if not loss.requires_grad:
            raise FitError(
                "the loss returned by step() does not require grad: was it computed under "
                "torch.no_grad(), or are all parameters frozen?"
            )

    def _say_fused(self) -> None:
        """Once a run, at fp16's first step: its scaler waits for the GPU each step with this optimizer,
        and the one-line fix where the optimizer has a fused mode."""
        self._said_fused = True
        fix = unfused_fix(self.optimizer, self.device)
        if fix is not None:
            self.session.emit("fused_hint", optimizer=type(self.optimizer).__name__, fix=fix)

    def _say_split(self, batch: Any, size: int) -> None:
        """Once a run each, the first time a batch is cut: what micro-batching changes for BatchNorm, and
        that a batch looking token-weighted has its pieces weighted by samples (without `items`)."""
        if not self._said_batch_norm:
            self._said_batch_norm = True
            self.session.emit(
                "batch_norm_micro_batched",
                layers=self.batch_norms,
                micro_batch=size,
                batch_size=self.state.batch_size,
            )
        if not self._said_items:
            self._said_items = True
            hint = token_weighted(batch)
            if hint is not None:
                self.session.emit("items_hint", why=hint[0], fix=hint[1], micro_batch=size)
