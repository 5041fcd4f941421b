"""fit(): the training loop gputui owns, so it can change how it trains between two steps.

Per global batch: apply the queued controls (the step boundary), split the batch into
micro-batches, run forward/backward on each with its loss weighted by its share, step the
optimizer, publish one sample. An out-of-memory error in forward or backward drops
everything the attempt held and replays the same batch with half the micro-batch, RNG
restored, counters untouched.
"""

from __future__ import annotations

import gc
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn

from ..probes.cpu import CpuProbe
from ..step.checkpointing import Checkpointing
from ..step.microbatch import batch_size, shapes, tensors, to_device, token_weighted
from ..step.precision import Precision
from ..step.sizing import Sizing
from ..telemetry.controls import BATCH_NORM_FLOOR, REMEDIES, Control
from ..telemetry.sample import Memory
from ..telemetry.setup import MetricsSink, for_process
from ..units import format_bytes
from .deferred import DeferredLoss
from .oom import Buffers, Generators, OomInfo, drop, is_oom
from .planning import NEAR_CAPACITY, NoPrediction, Planner, Setting
from .result import FitError, FitResult
from .session import RunSession

if TYPE_CHECKING:
    from .distributed import Agreed, Distributed

PREVENT_AT = 0.9
"""Under FSDP, the share of its capacity a rank's step peak may reach before every rank halves."""

HEARTBEAT_S = 1.0
"""Under torchrun, while paused, the ranks exchange this often (far within any process group's timeout)."""

REPEATED_SIGNAL_S = 2.0
"""Under torchrun a Ctrl-C reaches a rank twice (from the terminal, then passed on by torchrun): a
second signal this soon after the first is that one, not a request to stop at once."""

_RESETTINGS = frozenset({"halve_batch", "double_batch", "set_amp", "set_checkpointing"})
"""The controls after which a plan made before is stale."""

MAX_RETRIES = 16
"""OOMs in a row on one global batch before the run ends: a guard against remedies that do not help."""

THRASHING_STEPS = 3
"""Steps in a row with new allocator retries before a pre-emptive halving."""


def resolve_device(device: str | torch.device | None) -> torch.device:
    """None picks cuda, then mps, then cpu; "cuda" means the current CUDA device."""
    if device is None:
        if torch.cuda.is_available():
            device = "cuda"
        elif torch.backends.mps.is_available():
            device = "mps"
        else:
            device = "cpu"
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device='cuda' was asked for, but CUDA is not available here")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError("device='mps' was asked for, but MPS is not available here")
    return device


def _length(data: Any) -> int | None:
    try:
        return len(data)
    except TypeError:
        return None


def _shared(mode: str, model: nn.Module) -> bool:
    """Train as one rank of several: under torchrun (WORLD_SIZE > 1), or given a model in DDP."""
    if mode == "off":
        return False
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 or isinstance(model, torch.nn.parallel.DistributedDataParallel)


class _Forwarded(NamedTuple):
    """A rank's share up to its synced backward: the last micro-batch's loss (None: out of memory
    after DDP's synced forward returned, `oom`), its items, the micro-batch count, the loss so far."""

    loss: torch.Tensor | None
    items: int
    pieces: int
    loss_sum: torch.Tensor | None
    oom: OomInfo | None


def _positive(name: str, value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be a positive int or None, got {value!r}")


@dataclass(frozen=True)
class FitOptions:
    """fit()'s keyword arguments, checked once. The command line's settings (the hub's overrides)
    win over them in the RunSession, but for the metrics file: the command line's replaces fit's."""

    epochs: int | None = None
    max_steps: int | None = None
    scheduler: Any = None
    micro_batch: int | str | None = None
    amp: str = "off"
    checkpointing: bool | None = None  # None: as the model is (a Hugging Face model's own setting)
    checkpoint_modules: Sequence[nn.Module] | None = None
    device: str | torch.device | None = None
    memory_budget: int | str | None = None
    gpu_memory_limit: int | str | None = None
    auto_recover: bool = True
    metrics: str | os.PathLike[str] | None = None
    memory_history: bool = False
    snapshot_dir: str | os.PathLike[str] | None = None
    distributed: str = "auto"
    items: Callable[[Any], Any] | None = None
    planning: str = "auto"

    def __post_init__(self) -> None:
        for name in ("epochs", "max_steps"):
            _positive(name, getattr(self, name))
        if self.items is not None and not callable(self.items):
            raise TypeError(f"items must be a function items(batch) -> count, got {type(self.items).__name__}")
        if self.micro_batch != "auto":
            _positive("micro_batch", self.micro_batch)
        if self.distributed not in ("auto", "off", "fsdp"):
            raise ValueError(f'distributed must be "auto", "fsdp" or "off", got {self.distributed!r}')
        if self.planning not in ("auto", "asked", "off"):
            raise ValueError(f'planning must be "auto", "asked" or "off", got {self.planning!r}')
        if self.planning == "off" and self.micro_batch == "auto":
            raise ValueError('micro_batch="auto" needs the planner, and planning="off" never traces a step')


def fit(
    model: nn.Module,
    data: Iterable[Any],
    step: Callable[[nn.Module, Any], torch.Tensor],
    optimizer: torch.optim.Optimizer,
    *,
    epochs: int | None = None,
    max_steps: int | None = None,
    scheduler: Any = None,
    micro_batch: int | str | None = None,
    amp: str = "off",
    checkpointing: bool | None = None,
    checkpoint_modules: Sequence[nn.Module] | None = None,
    device: str | torch.device | None = None,
    memory_budget: int | str | None = None,
    gpu_memory_limit: int | str | None = None,
    auto_recover: bool = True,
    metrics: str | os.PathLike[str] | None = None,
    memory_history: bool = False,
    snapshot_dir: str | os.PathLike[str] = "gputui-snapshots",
    distributed: str = "auto",
    items: Callable[[Any], Any] | None = None,
    planning: str = "auto",
) -> FitResult:
    """Train `model` on `data` with live remedies and OOM recovery; see the README for each argument.

    `epochs=None` means one epoch, or as many as `max_steps` needs when that is given; with
    both, training stops at whichever comes first. Options given on the gputui command line
    win over the same arguments here. `distributed="auto"`: under torchrun, every rank trains its
    share of each global batch through DistributedDataParallel (see engine/distributed.py).
    `items(batch) -> count`: what the loss is a mean over (tokens that count); micro-batches are then
    weighted by their items, not their samples, so their gradients add up to the global batch's.
    `planning`: "auto" traces the step on fake tensors when it helps (after an OOM, near capacity,
    micro_batch="auto", a plan asked for), "asked" only for micro_batch="auto" and a plan asked for,
    "off" never (a trace runs step() once more: README, "The planner").
    """
    options = FitOptions(
        epochs=epochs,
        max_steps=max_steps,
        scheduler=scheduler,
        micro_batch=micro_batch,
        amp=amp,
        checkpointing=checkpointing,
        checkpoint_modules=checkpoint_modules,
        device=device,
        memory_budget=memory_budget,
        gpu_memory_limit=gpu_memory_limit,
        auto_recover=auto_recover,
        metrics=metrics,
        memory_history=memory_history,
        snapshot_dir=snapshot_dir,
        distributed=distributed,
        items=items,
        planning=planning,
    )
    return _Trainer(model, data, step, optimizer, options).run()


class _Trainer:
    def __init__(
        self,
        model: nn.Module,
        data: Iterable[Any],
        step: Callable[[nn.Module, Any], torch.Tensor],
        optimizer: torch.optim.Optimizer,
        o: FitOptions,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not callable(step):
            raise TypeError("step must be a function step(model, batch) -> loss")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if not hasattr(data, "__iter__"):
            raise TypeError(f"data must be an iterable of batches, got {type(data).__name__}")

        hub = for_process(sys.stdout)  # the installed hub; under plain `python script.py`, one of its own
        self.hub = hub
        self.model, self.data, self.step, self.optimizer, self.scheduler = model, data, step, optimizer, o.scheduler
        self.epochs = o.epochs if o.epochs is not None else (1 if o.max_steps is None else None)
        self.max_steps = o.max_steps
        shared = _shared(o.distributed, model)
        if shared:
            from . import distributed

            self.device = resolve_device(distributed.device_for(o.device))
        else:
            self.device = resolve_device(o.device)
        self.precision = Precision(self.device, o.amp)
        self.generators = Generators(self.device)
        self.checkpointing = Checkpointing(model, o.checkpoint_modules)
        reason = self.checkpointing.unavailable()
        if o.checkpointing and reason:
            raise ValueError(f"checkpointing=True, but {reason}")
        model.to(self.device)
        self.dist: Distributed | None = None
        if shared:
            shard = o.distributed == "fsdp"
            self.dist = distributed.Distributed(
                model, self.device, data, shard=shard, blocks=self.checkpointing.blocks, optimizer=optimizer
            )
            model = self.model = self.dist.model
        model.train()  # before Buffers: a train() override may keep BatchNorm layers in eval mode
        self.buffers = Buffers(model)
        # BatchNorm normalizes over the micro-batch: one sample has no variance (and is an error)
        self.sizing = Sizing(2 if self.buffers.batch_norms else 1)
        if isinstance(o.micro_batch, int) and o.micro_batch < self.sizing.floor:
            raise ValueError(
                f"micro_batch={o.micro_batch}, but the model has BatchNorm layers and "
                f"{BATCH_NORM_FLOOR}: use 2 or more, or GroupNorm/LayerNorm instead"
            )
        # Last, after every check that can fail: the script's own metrics file (unless the command
        # line named one), and the tracker, which hooks the parameters until run() ends.
        self._metrics = MetricsSink(hub, o.metrics if hub.overrides.metrics is None else None)
        try:
            self.session = RunSession(
                hub,
                self.device,
                tracked=model,
                optimizer=optimizer,
                memory_budget=o.memory_budget,
                gpu_memory_limit=o.gpu_memory_limit,
                snapshot_dir=o.snapshot_dir,
                memory_history=o.memory_history,
                keep_events=True,
            )
        except BaseException:
            self._metrics.close()
            raise
        self.tracker, self.probe, self.budget = self.session.tracker, self.session.probe, self.session.budget
        if self.tracker is not None:
            self.checkpointing.on_inputs = self.tracker.note_saved
        if o.checkpointing is not None:
            self.checkpointing.set(o.checkpointing)
        # A cap: None means the whole global batch; "auto": the largest predicted to fit, chosen at the first batch.
        self.micro_batch = o.micro_batch if isinstance(o.micro_batch, int) else None
        self._auto_micro_batch = o.micro_batch == "auto"
        self._checkpoint_modules = o.checkpoint_modules
        self.planner: Planner | None = None  # made the first time a prediction is asked for
        self._planning = o.planning
        self._sharded = self.dist is not None and self.dist.fsdp
        self._shapes: Hashable = None  # the batch's shapes, as the last _train saw them
        self.auto_recover = o.auto_recover
        self.items = o.items
        self._units = 0  # this rank's share of the global batch's items (samples without `items`)

        self.epochs_done = self.epoch = self.ooms_recovered = 0
        self.batch_size = 0
        self.accumulation = 1
        self._losses = DeferredLoss.for_device(self.device)
        self.loss: float | None = None  # the newest loss read (on CUDA a step late: result() waits for the last)
        self.stop_reason: str | None = None
        self._signal: str | None = None
        self._warned_loss = False
        self._said_batch_norm = not self.buffers.batch_norms  # said once, or nothing to say
        self._said_items = self.items is not None  # the token-mean hint: said once, or not needed
        self._retries = (0, 0)  # (alloc retries at the last step, steps in a row they grew)
        self._baseline = self.probe.allocated()  # allocated between steps: where an OOM must return to
        self._memory: Memory | None = None  # after the last step: its peak goes into the next exchange
        self._cooling = 0  # steps before FSDP's OOM prevention looks at the peaks again
        self._ooms_seen: dict[int, int] = {}  # every other rank's OOMs recovered, as the last exchange said
        self._thrashing = False  # this rank's allocator thrashed since its last exchange
        self._handlers: dict[str, Callable[[Control], bool]] = {
            "halve_batch": self._resize,
            "double_batch": self._resize,
            "set_amp": self._set_amp,
            "set_checkpointing": self._set_checkpointing,
            "set_auto_recover": self._set_auto_recover,
            "plan": self._plan,
            "stop": self._request_stop,
        }

    @property
    def steps(self) -> int:
        return self.session.steps

    @property
    def samples(self) -> int:
        return self.session.samples

    # -- the run ----------------------------------------------------------------------------
    def run(self) -> FitResult:
        with self._metrics:
            return self._run()

    def _run(self) -> FitResult:
        self._start()
        restore_signals = self._install_signals()
        error: str | None = None
        try:
            self.optimizer.zero_grad(set_to_none=True)
            if self.tracker:
                self.tracker.reset()
                if self.budget is not None and self.tracker.total > self.budget:
                    message = (
                        f"the memory budget ({format_bytes(self.budget)}) is smaller than the model's "
                        f"parameters and optimizer state ({format_bytes(self.tracker.total)}): no batch can fit"
                    )
                    if self.dist is None:
                        raise FitError(message)
                    from .distributed import Failure

                    self.dist.failure = Failure(message, oom=True)  # said at the first exchange
            if self.dist is not None:
                self._loop_shared(self.dist)
            else:
                self._loop()
            if self.stop_reason:
                self.session.emit("stopped", reason=self.stop_reason)
            return self.result()
        except FitError as exc:
            error = str(exc)
            exc.result = self.result()
            raise
        except BaseException as exc:
            error = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            if error is not None:
                self.session.emit("error", message=error)
            if self.planner is not None:
                self.planner.abandon("the run ended before the plan was complete")
            restore_signals()
            self.generators.close()
            self.checkpointing.remove()
            if self.dist is not None:
                self.dist.close()
            self.session.close_tracker()
            self.session.end(self.result().summary(error))

    def _loop(self) -> None:
        epoch = 0
        while self.epochs is None or epoch < self.epochs:
            self.epoch = epoch
            trained = 0
            for batch in self.data:
                self.batch_size = batch_size(batch)
                if not self._boundary(batch):
                    return
                self._plan_at_boundary(batch)
                if not self._train(batch):
                    return
                trained += 1
                self._publish()
                if self.max_steps is not None and self.steps >= self.max_steps:
                    if trained == _length(self.data):
                        self.epochs_done += 1  # the last step was also the end of the epoch
                    return
            if trained == 0:
                if epoch == 0:
                    raise FitError("data yielded no batches: nothing to train on")
                raise FitError(
                    f"data yielded no batches in epoch {epoch + 1}: it can be iterated only once "
                    "(a generator?); pass a DataLoader or a list, or set epochs=1"
                )
            self.epochs_done += 1
            epoch += 1

    def _loop_shared(self, d: Distributed) -> None:
        """_epochs_shared(), then one closing exchange: a failure said after the last step (an
        optimizer.step() that failed there) reaches every rank, which raise FitError together."""
        self._epochs_shared(d)
        d.set_epoch(self.epochs_done)  # a later fit on the same sampler goes on with the next shuffle
        agreed = d.exchange(items=None, has_next=False, stop=None)
        if agreed.fatal:
            raise self._fit_error(d, agreed, closing=True)

    def _next_shared(self, d: Distributed, batches: Any, end: object) -> Any:
        """The next batch; one the data cannot give (a worker's error) is this rank's failure, said at
        the exchange, instead of an exception the other ranks would wait on."""
        from .distributed import Failure

        if d.failure is not None:
            return end
        try:
            return next(batches, end)
        except Exception as exc:
            d.failure = Failure(f"{type(exc).__name__} on rank {d.rank} reading the data: {exc}", oom=False, error=exc)
            return end

    def _epochs_shared(self, d: Distributed) -> None:
        """_loop() as one rank of several: each rank looks one batch ahead, so the exchange of a step
        can say whether every rank has another; when one has not, every rank ends the epoch there."""
        end = object()
        epoch = 0
        while self.epochs is None or epoch < self.epochs:
            self.epoch = epoch
            d.set_epoch(epoch)
            batches = iter(self.data)
            batch = self._next_shared(d, batches, end)
            trained = 0
            while True:
                here = batch is not end
                if here:
                    self.batch_size = batch_size(batch)
                if not self._boundary():
                    return
                if here:
                    self._plan_at_boundary(batch)
                last = self.max_steps is not None and self.steps + 1 >= self.max_steps
                ahead = end if last or not here else self._next_shared(d, batches, end)
                more = self._train_shard(batch if here else None, ahead is not end)
                trained += 1
                self._publish()
                if self.max_steps is not None and self.steps >= self.max_steps:
                    if trained == _length(self.data):
                        self.epochs_done += 1
                    return
                if not more:
                    break
                batch = ahead
            self.epochs_done += 1
            epoch += 1

    # -- the step boundary ------------------------------------------------------------------
    def _boundary(self, batch: Any = None) -> bool:
        """Apply every queued control; while paused, wait here (a plan asked for is made meanwhile, on
        `batch`). False: stop before the next step."""
        if self.dist is not None:
            return self._boundary_shared(self.dist)
        hub = self.hub
        if hub.controls or self.session.paused:  # most boundaries: nothing to apply or wait for

            def apply() -> None:
                self._apply_queued()
                self._plan_paused(batch)

            apply()
            self.session.wait_while_paused(apply, self._stopping)
        if self._signal is None and hub.stop_signal is None:  # most boundaries: _stopping() has nothing to take
            return self.stop_reason is None
        return not self._stopping()

    def _apply_queued(self) -> list[Control]:
        """Apply what is queued, in order; returns the controls that changed something.

        Requests to free the cache are merged: one gc + empty_cache per boundary is all it takes,
        and each costs a full garbage collection."""
        return self._apply_all(self.hub.controls.drain())

    def _apply_all(self, controls: list[Control]) -> list[Control]:
        applied, freed = [], False
        for control in controls:
            if control.action == "free_cache":
                if freed:
                    self.session.refuse(control, "the cache was freed at this boundary already")
                    continue
                freed = True
            if self._apply(control):
                applied.append(control)
        planner = self.planner
        if planner is not None and planner.planned and any(c.action in _RESETTINGS for c in applied):
            planner.ask("changed")  # the remedies line keeps its predictions for the new setting
        return applied

    def _boundary_shared(self, d: Distributed) -> bool:
        """One rank's boundary: apply what the last exchange announced (every rank the same, so every
        rank the same state), then keep what was requested here for the next exchange. A stop, a
        signal or a control on one rank reaches the others there, one step later."""
        self._align(d)
        self._prevent(d)
        self._apply_all(d.take_agreed())
        while self.session.paused and self.stop_reason is None:
            # Every rank paused at this boundary together: a heartbeat exchange a second keeps the
            # process group within its timeout and brings a resume, a stop or a control from any rank.
            self.hub.controls.wait(HEARTBEAT_S)
            self._queue_asked(d)
            self._exchange(d, here=True, has_next=True)
            self._apply_all(d.take_agreed())
        if self.stop_reason is not None:  # agreed at the last exchange
            return False
        self._queue_asked(d)
        return True

    def _prevent(self, d: Distributed) -> None:
        """Halve every rank alike, from what the last exchange told every rank: when a rank's allocator
        thrashed (the slow road to an OOM; a rank halving alone would leave the others' passes and
        settings apart), and under FSDP, where an OOM mid-step ends the run, when a rank's step peak
        reached PREVENT_AT of its capacity. Then two steps pass before it looks again (the exchange's
        figures are a step late)."""
        if self._cooling:
            self._cooling -= 1
            return
        if not self.auto_recover or not d.ranks:
            return
        shares = [(r.peak / r.capacity, r.rank) for r in d.ranks if r.peak is not None and r.capacity]
        share, rank = max(shares) if shares else (0.0, 0)
        if d.thrashing:
            reason = f"rank {d.thrashing[0]}'s allocator thrashing (retrying allocations step after step)"
        elif d.fsdp and share >= PREVENT_AT:
            reason = f"rank {rank}'s step peak at {share:.0%} of its capacity (under FSDP an OOM ends the run)"
        else:
            return
        current, _ = d.job_sizes()
        if not self.sizing.can_halve(current):
            return
        new = self.sizing.halved(current)
        self.micro_batch, self._cooling = new, 2
        d.resized(new)
        details: dict[str, Any] = {"from": current, "to": new, "accumulation": self._accumulation(new)}
        self.session.emit("micro_batch_changed", **details, reason=reason)

    def _queue_asked(self, d: Distributed) -> None:
        """Controls asked of this rank: for the next exchange (what this run refuses, answered now)."""
        outgoing = []
        for control in self.hub.controls.drain():
            if control.action in self.session.refused:
                self.session.apply(control)  # refused with its reason, here and now
            else:
                outgoing.append(control)
        d.queue(outgoing)

    def _exchange(self, d: Distributed, *, here: bool, has_next: bool) -> Agreed:
        """The exchange with what this rank says: its batch (`here`), a signal, its micro-batch and
        batch, its last step's peak and capacity. A stop agreed there is this rank's from now on."""
        signalled = self._signal or self.hub.stop_signal
        memory, latest = self._memory, self.hub.latest()
        agreed = d.exchange(
            items=self._units if here else None,
            has_next=has_next,
            stop=signalled,
            micro_batch=self._micro_batch() if here else None,
            setting=self.micro_batch,
            batch=self.batch_size if here else None,
            peak=memory.peak if memory is not None else None,
            capacity=memory.capacity if memory is not None else None,
            loss=self.loss,
            samples_per_s=latest.samples_per_s if latest is not None else None,
            ooms=self.ooms_recovered,
            thrashing=self._thrashing,
        )
        self._thrashing = False  # said
        if agreed.stop is not None and self.stop_reason is None:
            self.stop_reason = signalled or agreed.stop
        for r in d.ranks:  # another rank's OOM, recovered alone: said here too (each screen shows one rank)
            if r.rank != d.rank and r.ooms > self._ooms_seen.get(r.rank, 0):
                self.session.emit("rank_oom_recovered", rank=r.rank, ooms=r.ooms, micro_batch=r.micro_batch)
            self._ooms_seen[r.rank] = r.ooms
        return agreed

    def _align(self, d: Distributed) -> None:
        """Every rank to the smallest micro-batch setting any rank had at the last exchange."""
        aligned = d.aligned()
        if aligned is None or aligned[0] == self.micro_batch:
            return
        size, rank = aligned
        current = self._micro_batch()
        self.micro_batch = size
        new = self._micro_batch()
        if new != current:
            details: dict[str, Any] = {"from": current, "to": new, "accumulation": self._accumulation(new)}
            self.session.emit("micro_batch_changed", **details, reason=f"aligned with rank {rank}")

    def _stopping(self) -> bool:
        signalled = self._signal or self.hub.stop_signal  # the hub's: set where fit is not the main thread
        if signalled and not self.stop_reason:
            self.stop_reason = signalled
        return self.stop_reason is not None

    def _apply(self, control: Control) -> bool:
        """Apply one control; True if it changed something. Every request is answered by an event."""
        applied = self.session.apply(control)
        if applied is not None:
            return applied
        return self._handlers[control.action](control)

    def _resize(self, control: Control) -> bool:
        current, batch = self._micro_batch(), self.batch_size
        if self.dist is not None and self.dist.ranks:  # the job's (the largest rank's): every rank decides alike
            current, batch = self.dist.job_sizes()
        if control.action == "halve_batch":
            why = self.sizing.why_not_halve(current)
            if why:
                return self.session.refuse(control, why)
            new = self.sizing.halved(current)
        else:
            if current >= batch:
                return self.session.refuse(control, f"the micro-batch already equals the global batch ({batch})")
            new = self.sizing.doubled(current, batch)
        self.session.emit(
            "micro_batch_changed", control, **{"from": current, "to": new}, accumulation=self._accumulation(new)
        )
        self.micro_batch = new
        if self.dist is not None:
            self.dist.resized(new)
        return True

    def _set_amp(self, control: Control) -> bool:
        value = control.value
        if value == self.precision.mode:
            return self.session.refuse(control, f"AMP is already {value}")
        reason = self.precision.unsupported(value)
        if reason:
            return self.session.refuse(control, reason)
        old = self.precision.mode
        self.precision.set(value)
        self.session.emit("amp_changed", control, **{"from": old, "to": value})
        return True

    def _set_checkpointing(self, control: Control) -> bool:
        if control.value == self.checkpointing.enabled:
            return self.session.refuse(control, f"checkpointing is already {'on' if control.value else 'off'}")
        self.checkpointing.set(control.value)
        self.session.emit("checkpointing_changed", control, enabled=control.value, how=self.checkpointing.how)
        return True

    def _set_auto_recover(self, control: Control) -> bool:
        if control.value == self.auto_recover:
            return self.session.refuse(control, f"auto-recover is already {'on' if control.value else 'off'}")
        self.auto_recover = control.value
        self.session.emit("auto_recover_changed", control, enabled=control.value)
        return True

    def _plan(self, control: Control) -> bool:
        fresh = self.planner is None
        planner = self._get_planner()
        if fresh and self._memory is not None:
            self._calibrate(self._memory)  # the table says what the last step measured
        planner.ask("asked", control)  # answered at this boundary, once the batch is known
        return True

    def _request_stop(self, control: Control) -> bool:
        self.stop_reason = "requested"
        return True

    def _micro_batch(self) -> int:
        return min(self.micro_batch or self.batch_size, self.batch_size)

    def _accumulation(self, micro_batch: int) -> int:
        """Micro-batches a global batch is cut into (as _attempt cuts it)."""
        return self.sizing.accumulation(self.batch_size, micro_batch)

    # -- one global batch -------------------------------------------------------------------
    def _train(self, batch: Any) -> bool:
        """Train on one global batch, retrying it after OOMs. False: stopped before it was trained."""
        self.generators.start()
        self.buffers.save()
        retries = 0
        try:
            while True:
                size = self._micro_batch()
                if self.tracker is not None:  # what this step saves for backward depends on these alone
                    self._shapes = shapes(batch)
                    self.tracker.start_step(
                        (size, self.precision.mode, self.checkpointing.enabled, self._shapes), tensors(batch)
                    )
                self.probe.start_step()
                oom = self._attempt(batch, size, self._baseline)
                if oom is None:
                    return True
                self._drop_step()
                retries += 1
                if not self._recover(oom, retries, batch):
                    return False
        finally:
            self.generators.end()

    def _attempt(self, batch: Any, size: int, allocated_before: int) -> OomInfo | None:
        """One try at a global batch in micro-batches of `size`; the OOM if it ran out of memory."""
        pieces = self.sizing.split(batch, size, self.batch_size)
        count = len(pieces)
        if count > 1:
            self._say_split(batch, size)
        scaler = self.precision.scaler
        tracker = self.tracker
        counting = tracker if tracker is not None and tracker.counting else None  # uncounted, nothing saved to free
        phase = "forward"
        try:
            loss_sum = None
            counts, units = self._counts(pieces, size) if count > 1 else ([], 0)
            if count > 1 and not units:
                raise FitError(f"items() counted 0 items in the whole batch of step {self.steps + 1}: no loss to train")
            for i, piece in enumerate(pieces):
                if count > 1 and not counts[i]:
                    continue  # a loss over no items (a mean over nothing) weighs nothing
                phase = "forward"
                loss = self._forward(piece)
                phase = "backward"
                if count == 1:  # most steps: the batch whole, its loss as it is (read detached: the graph goes)
                    weighted, loss_sum = loss, loss.detach()
                else:
                    weighted = loss * (counts[i] / units)
                (scaler.scale(weighted) if scaler is not None else weighted).backward()
                if counting is not None:
                    counting.end_micro_batch()
                if count > 1:  # summed in float32, out of the graph
                    detached = weighted.detach().float()
                    loss_sum = detached if loss_sum is None else loss_sum + detached
            del piece, loss, weighted
            phase = "optimizer"
            self._optimizer_step()
        except Exception as exc:
            if not is_oom(exc):
                raise
            if self.session.memory_history:  # now, while the failed step's tensors are still alive
                self.session.snapshot("oom")
            return OomInfo(phase, drop(exc), size, allocated_before)
        assert loss_sum is not None  # the batch had at least one piece
        self._step_done(loss_sum, count)
        return None

    # -- one global batch as one rank of several ----------------------------------------------
    def _train_shard(self, batch: Any, has_next: bool) -> bool:
        """Train this rank's share of a global batch (None: its data ran out). True: every rank has
        another batch this epoch. An OOM before the exchange (a forward, a no_sync backward) is this
        rank's alone: it replays its share at half the micro-batch while the others wait in the
        exchange. An OOM in the synced backward is replayed by every rank (the failing one at half
        its micro-batch). What cannot be recovered ends the run on every rank (FitError)."""
        d = self.dist
        assert d is not None
        if d.fsdp:
            return self._train_fsdp(d, batch, has_next)
        self.generators.start()
        self.buffers.save()
        attempt = 0
        try:
            while True:
                attempt += 1
                last = None
                while d.failure is None and batch is not None:
                    outcome = self._forward_shard(d, batch)
                    if not isinstance(outcome, OomInfo):
                        last = outcome
                        break
                    if d.prepared is not None:  # past DDP's synced forward: every rank must see it through
                        last = _Forwarded(None, 0, 0, None, outcome)
                        break
                    self._drop_step()  # this rank's no_sync gradients, draws and running statistics
                    self._recover_alone(d, outcome, attempt)
                    attempt += 1
                agreed = self._exchange(d, here=batch is not None, has_next=has_next)
                if agreed.fatal or not agreed.all_have_batch:
                    self._drop_step()
                    raise self._fit_error(d, agreed)
                assert last is not None
                done, oom = self._synced_shard(d, agreed, last, attempt)
                d.rebuild_buckets()
                if done:
                    return agreed.all_have_next
                self._drop_step()  # every rank: the step's gradients, draws and running statistics
                if oom is not None:
                    self._recover(oom, attempt)  # halves: _synced_shard checked that it can
        finally:
            self.generators.end()

    def _train_fsdp(self, d: Distributed, batch: Any, has_next: bool) -> bool:
        """_train_shard() under FSDP2, where every forward all-gathers and every synced backward
        reduce-scatters: no rank can replay alone, so the exchange comes first (the global batch is
        known before any forward: each micro-batch's loss is weighted by its share of it), and any
        failure ends the run (OOMs are prevented instead: _prevent())."""
        if batch is not None:
            self._count_share(d, batch)
        agreed = self._exchange(d, here=batch is not None, has_next=has_next)
        if agreed.fatal or not agreed.all_have_batch:
            raise self._fit_error(d, agreed)
        if not agreed.items:
            raise FitError(f"items() counted 0 items in the whole global batch of step {self.steps + 1}, on every rank")
        total, world = self.batch_size, d.world_size
        # Every rank runs as many passes as the one that needs the most (each all-gathers): a rank
        # with fewer samples splits its share finer, and one with fewer samples than passes repeats
        # its last piece at weight 0.
        count = d.passes(self.micro_batch)
        size = -(-total // count)
        if self.tracker is not None:
            self.tracker.start_step(
                (size, self.precision.mode, self.checkpointing.enabled, shapes(batch)), tensors(batch)
            )
        self.probe.start_step()
        pieces = self.sizing.split(batch, size, total)
        real = len(pieces)
        if count > 1:
            self._say_split(batch, size)
        scaler, tracker = self.precision.scaler, self.tracker
        phase = "forward"
        loss_sum = None
        try:
            counts = self._counts(pieces, size)[0] if real > 1 else [self._units]
            counts += [0] * (count - real)
            pieces += [pieces[-1]] * (count - real)
            for i, piece in enumerate(pieces):
                n = counts[i]
                d.gradient_sync(i == count - 1)
                phase = "forward"
                loss = self._forward(piece)
                phase = "backward"
                weighted = loss * (world * n / agreed.items)  # FSDP averages over the ranks, as DDP does
                (scaler.scale(weighted) if scaler is not None else weighted).backward()
                if tracker is not None:
                    tracker.end_micro_batch()
                local = loss.detach().float() * (n / self._units if self._units else 0.0)
                loss_sum = local if loss_sum is None else loss_sum + local
            del piece, loss, weighted
            phase = "optimizer"
            d.broadcast_buffers()
            self._optimizer_step()
        except Exception as exc:
            raise self._fsdp_failure(d, exc, phase, size) from None
        finally:
            d.gradient_sync(True)
        assert loss_sum is not None
        self._step_done(loss_sum, count)
        return agreed.all_have_next

    def _count_share(self, d: Distributed, batch: Any) -> None:
        """This rank's items for the exchange (its samples without `items`); a count that fails is this
        rank's failure, said there, not an exception the other ranks would wait on."""
        from .distributed import Failure

        try:
            self._units = self._count(batch) if self.items is not None else self.batch_size
        except Exception as exc:
            message = str(exc) if isinstance(exc, FitError) else f"{type(exc).__name__}: {exc}"
            where = f"rank {d.rank}, step {self.steps + 1}, counting items"
            d.failure = Failure(f"{where}: {message}", oom=False, error=exc)

    def _fsdp_failure(self, d: Distributed, exc: Exception, phase: str, size: int) -> FitError:
        """A failure mid-step under FSDP: this rank cannot complete the collectives the others are in,
        so it leaves the group (a group fit made) and every rank ends with a FitError."""
        from .distributed import is_transport, lost_ranks

        if isinstance(exc, FitError):  # said already (a lost rank in fit's own collective)
            return exc
        oom = is_oom(exc)
        if not oom and is_transport(exc):  # another rank left: this one did nothing wrong
            error = lost_ranks(exc)  # before abort(): it names this rank from the group
            d.abort()
            return error
        what = f"out of memory in {phase}" if oom else f"{type(exc).__name__} in {phase}"
        detail = drop(exc) if oom else str(exc).splitlines()[0] if str(exc) else ""
        if oom:
            self.session.emit("oom", phase=phase, message=detail, micro_batch=size, recovered=False)
        d.abort()
        return FitError(
            f"{what} at micro-batch {size} on rank {d.rank}, step {self.steps + 1}, under FSDP: a rank cannot "
            "finish its step's collectives alone, so every rank stops (fit halves every rank before a step "
            f"peak nears its capacity; this came first) [{detail}]"
        )

    def _forward_shard(self, d: Distributed, batch: Any) -> _Forwarded | OomInfo | None:
        """Every micro-batch under no_sync() but the last, and the last one's forward: nothing
        collective. Returns the OOM when this rank ran out of memory (it replays alone unless
        d.prepared says DDP's synced forward returned before it); None when it failed otherwise
        (d.failure says how)."""
        from .distributed import Failure

        size = self._micro_batch()
        if self.tracker is not None:
            self.tracker.start_step(
                (size, self.precision.mode, self.checkpointing.enabled, shapes(batch)), tensors(batch)
            )
        self.probe.start_step()
        pieces = self.sizing.split(batch, size, self.batch_size)
        count = len(pieces)
        if count > 1:
            self._say_split(batch, size)
        scaler, tracker = self.precision.scaler, self.tracker
        phase = "forward"
        loss_sum = None
        d.prepared = None
        try:
            counts, self._units = self._counts(pieces, size)  # weighted by this rank's share until the exchange
            for i, piece in enumerate(pieces):
                n = counts[i]
                if not n and i < count - 1:
                    continue  # a loss over no items weighs nothing (the last piece runs: it syncs)
                phase = "forward"
                with nullcontext() if i == count - 1 else d.model.no_sync():
                    loss = self._forward(piece)
                    if i == count - 1:
                        return _Forwarded(loss, n, count, loss_sum, None)
                    phase = "backward"
                    weighted = loss * (n / self._units)
                    (scaler.scale(weighted) if scaler is not None else weighted).backward()
                if tracker is not None:
                    tracker.end_micro_batch()
                detached = weighted.detach().float()
                loss_sum = detached if loss_sum is None else loss_sum + detached
        except Exception as exc:
            if is_oom(exc):
                if self.session.memory_history:  # now, while the failed attempt's tensors are still alive
                    self.session.snapshot("oom")
                return OomInfo(phase, drop(exc), size, self._baseline)
            message = str(exc)
            if d.ours and "find_unused_parameters" in message:  # DDP's advice names a constructor fit called
                from .distributed import UNUSED

                message = f"{UNUSED} [{message.splitlines()[0]}]"
            if not isinstance(exc, FitError):
                message = f"{type(exc).__name__} on rank {d.rank}, step {self.steps + 1}: {message}"
            d.failure = Failure(message, oom=False, error=exc)
        return None

    def _recover_alone(self, d: Distributed, oom: OomInfo, attempt: int) -> None:
        """An OOM before this rank's first collective of the step: halve and replay here, as one
        process would; what one process would end with (micro-batch 1, the retry cap) is said at the
        exchange instead, so every rank ends together. Auto-recover off ends the run too: the others
        wait in a collective, and a process group's timeout is not a time to think in."""
        from .distributed import Failure

        try:
            if not self.auto_recover:
                self.session.emit(
                    "oom", phase=oom.phase, message=oom.message, micro_batch=oom.micro_batch, recovered=False
                )
                raise FitError(
                    f"out of memory in {oom.phase} at micro-batch {oom.micro_batch} with auto-recover off: under "
                    f"torchrun a rank cannot wait for a remedy while the others wait for it [{oom.message}]"
                )
            self._recover(oom, attempt)
        except FitError as exc:
            d.failure = Failure(f"rank {d.rank}, step {self.steps + 1}: {exc}", oom=True)

    def _synced_shard(
        self,
        d: Distributed,
        agreed: Agreed,
        last: _Forwarded,
        attempt: int,
    ) -> tuple[bool, OomInfo | None]:
        """The last backward (DDP all-reduces its buckets), then the step. DDP averages the ranks'
        gradients; scaled by world_size * (this rank's items) / (all ranks' items), the average is
        the gradient of the mean loss over the global batch (its samples, or its `items`), uneven
        shards included."""
        world = d.world_size
        loss, n, count, loss_sum = last.loss, last.items, last.pieces, last.loss_sum
        if not agreed.items:  # the same on every rank: all raise here, before any collective
            self._drop_step()
            raise FitError(f"items() counted 0 items in the whole global batch of step {self.steps + 1}, on every rank")
        scale = world * self._units / agreed.items
        if count > 1 and scale != 1:  # the no_sync micro-batches were weighted by this rank's share alone
            for group in self.optimizer.param_groups:
                grads = [p.grad for p in group["params"] if p.grad is not None]
                if grads:
                    torch._foreach_mul_(grads, scale)
        scaler, tracker = self.precision.scaler, self.tracker
        d.begin_synced()
        failed, oom = last.oom, True
        weighted = None
        if loss is not None:
            weighted = loss * (world * n / agreed.items)
            try:
                (scaler.scale(weighted) if scaler is not None else weighted).backward()
            except Exception as exc:
                oom = is_oom(exc)
                message = drop(exc) if oom else f"{type(exc).__name__}: {drop(exc)}"
                failed = OomInfo("backward", message, self._micro_batch(), self._baseline)
        fatal = False
        if failed is not None:
            halvable = self.sizing.can_halve(failed.micro_batch)
            fatal = not (oom and self.auto_recover and halvable and attempt <= MAX_RETRIES)
            if not d.failed_synced(fatal):  # after its gradients went out: the others step on them
                from .distributed import Failure

                self._drop_step()
                d.failure = Failure(f"{failed.message} after the synced backward on rank {d.rank}", oom=oom)
                return False, None  # said at the next exchange, where every rank stops
            # What the zeros must reach, then the failed graph let go before they are allocated: this
            # rank has just run out of memory.
            reached = d.reached([weighted] if weighted is not None else d.prepared or [])
            loss = weighted = d.prepared = None
            del last
            self.probe.free_cache()
            self._complete_buckets(d, reached, failed.message)
        else:
            del last
        del loss
        d.prepared = None
        failures, fatals, ranks = d.agree_valid()
        if failures:
            del weighted
            if not fatals:
                return False, failed
            self._drop_step()
            if failed is not None:
                if fatal:
                    details: dict[str, Any] = {
                        "phase": failed.phase,
                        "message": failed.message,
                        "micro_batch": failed.micro_batch,
                    }
                    self.session.emit("oom", **details, recovered=False)
                raise FitError(
                    f"{failed.message} in the synced {failed.phase} at micro-batch {failed.micro_batch} on rank "
                    f"{d.rank}, step {self.steps + 1}: cannot recover here, so every rank stops"
                )
            raise FitError(
                f"rank {', '.join(map(str, ranks))} stopped at step {self.steps + 1} (in the synced backward): "
                "every rank stops; that rank's output says why"
            )
        assert weighted is not None
        if tracker is not None:
            tracker.end_micro_batch()
        local = weighted.detach().float() / scale if scale else weighted.detach().float()  # this rank's mean
        loss_sum = local if loss_sum is None else loss_sum + local
        del weighted
        d.broadcast_buffers()
        try:
            self._optimizer_step()
        except Exception as exc:
            # Not safe to retry (the parameters may be partly updated) and the others have stepped:
            # this rank ends the step as they do and says it at the next exchange (or the closing
            # one), where every rank raises FitError together.
            from .distributed import Failure

            oom = is_oom(exc)
            why = "out of memory" if oom else f"{type(exc).__name__}"
            message = (
                f"{why} inside optimizer.step() on rank {d.rank} at step {self.steps + 1}: not safe to retry, "
                f"so every rank stops [{drop(exc) if oom else exc}]"
            )
            if oom:
                self.session.emit("oom", phase="optimizer", message=message, recovered=False)
            d.failure = Failure(message, oom=oom, error=None if oom else exc)
        self._step_done(loss_sum, count)
        return True, None

    def _complete_buckets(self, d: Distributed, reached: set[int] | None, message: str) -> None:
        """The synced step failed here: finish DDP's reduction with zeros so no rank is left in it
        (the memory budget is lifted meanwhile: those gradients were counted against it already)."""
        tracker = self.tracker
        budget = tracker.budget if tracker is not None else None
        if tracker is not None:
            tracker.budget = None
        try:
            d.complete_buckets(reached)
        except Exception as exc:
            raise FitError(
                f"{message} in the synced backward on rank {d.rank}, step {self.steps + 1}, and completing its "
                f"gradient buckets failed too: the other ranks may be left waiting [{drop(exc)}]"
            ) from None
        finally:
            if tracker is not None:
                tracker.budget = budget

    def _fit_error(self, d: Distributed, agreed: Agreed, closing: bool = False) -> FitError:
        """The error every rank raises together after a step some rank could not train (`closing`: at
        the exchange after the last step)."""
        if d.failure is not None:
            error = FitError(d.failure.message)
            error.__cause__ = d.failure.error
            return error
        if agreed.fatal:
            ranks = ", ".join(map(str, agreed.fatal_ranks)) or "another rank"
            why = "out of memory" if agreed.fatal_oom == agreed.fatal else "an error"
            when = f"after step {self.steps}" if closing else f"at step {self.steps + 1}"
            return FitError(f"rank {ranks} stopped {when} ({why}): every rank stops; that rank's output says why")
        return FitError(
            f"a rank's data yielded no batch in epoch {self.epoch + 1} while others had some: each rank needs "
            "at least one (a DistributedSampler gives every rank the same number)"
        )

    def _forward(self, piece: Any) -> torch.Tensor:
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

    def _step_done(self, loss_sum: torch.Tensor, pieces: int) -> None:
        """After optimizer.step(): the gradients and counted bytes go, the schedule and counters move."""
        self.optimizer.zero_grad(set_to_none=True)
        if self.tracker is not None:
            self.tracker.reset()
        if self.scheduler is not None:
            self.scheduler.step()
        self.loss = self._losses.put(loss_sum)  # no wait for the device (engine/deferred.py)
        self.accumulation = pieces
        session = self.session
        session.steps += 1
        session.samples += self.batch_size

    def _optimizer_step(self) -> None:
        scaler = self.precision.scaler
        if scaler is not None:
            scaler.step(self.optimizer)
            scaler.update()
        else:
            self.optimizer.step()
        if self.tracker is not None:
            self.tracker.refresh_optimizer()

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

    def _drop_step(self) -> None:
        """After an OOM: no gradient, no cached block, no counted byte, no draw from a generator and no
        running-statistics update of the failed attempt survives (no full gc either, unless device
        memory is still held: Probe.after_oom)."""
        self.optimizer.zero_grad(set_to_none=True)
        self.generators.restore()
        self.buffers.restore()
        if self.tracker is not None:
            self.tracker.reset()
        self.probe.after_oom(self._baseline)
        if self.dist is not None:
            # A failed attempt's DDP/FSDP objects can sit in an old generation's cycle: one left to the
            # interpreter's exit is torn down after its process group and aborts the process (SIGABRT in
            # 2 of 22 FSDP test launches with the young generations' collection alone, 0 of 15 with this).
            gc.collect()

    def _recover(self, oom: OomInfo, retries: int, batch: Any = None) -> bool:
        """Decide what follows an OOM; True: retry the batch. Raises FitError when the run must end.
        With the batch (one process), the planner picks the largest micro-batch predicted to fit;
        under torchrun every rank halves, which every rank can decide alike."""
        details: dict[str, Any] = {
            "phase": oom.phase,
            "message": oom.message,
            "micro_batch": oom.micro_batch,
            "attempt": retries,
            "allocated_before": oom.allocated_before,
            "leaked": max(0, self.probe.allocated() - oom.allocated_before),
        }
        if oom.phase == "optimizer":
            self.session.emit("oom", **details, recovered=False)
            raise FitError(
                f"out of memory inside optimizer.step() at step {self.steps + 1}: not safe to retry (the "
                "parameters may be partly updated), so training stops. Optimizer state does not shrink "
                "with the micro-batch: use a lighter optimizer, fewer trainable parameters or more "
                f"memory. [{oom.message}]"
            )
        if retries > MAX_RETRIES:
            self.session.emit("oom", **details, recovered=False)
            raise FitError(
                f"gave up after {MAX_RETRIES} out-of-memory errors in a row on the same batch "
                f"(last in {oom.phase}: {oom.message})"
            )
        if self.auto_recover:
            if oom.micro_batch <= 1:
                self.session.emit("oom", **details, recovered=False)
                raise FitError(
                    f"out of memory in {oom.phase} at micro-batch 1: not even one sample fits. Try AMP "
                    f"(bf16), activation checkpointing, a shorter sequence or a smaller model ({oom.message})"
                )
            if oom.micro_batch <= self.sizing.floor:
                self.session.emit("oom", **details, recovered=False)
                raise FitError(
                    f"out of memory in {oom.phase} at micro-batch {oom.micro_batch}, and the model has "
                    f"BatchNorm layers: {BATCH_NORM_FLOOR}, so it cannot be halved again. Replace them "
                    "with GroupNorm or LayerNorm (they do not depend on the batch), or make room: AMP "
                    "(bf16), activation checkpointing, a smaller model or more memory (SyncBatchNorm only "
                    f"helps with the batch spread over several GPUs) ({oom.message})"
                )
            new, why = self.sizing.halved(oom.micro_batch), "halved"
            picked = self._pick_after_oom(oom, batch) if batch is not None else None
            if picked is not None:
                new, why = picked
            self.ooms_recovered += 1
            self.micro_batch = new
            self.session.emit(
                "oom_recovered", **details, micro_batch_to=new, accumulation=self._accumulation(new), reason=why
            )
            return True
        # Auto-recover off: wait at this boundary for the user. A remedy or resume retries the batch.
        # With the batch (one process) the planner's table for the dialog is made first, and plans
        # asked for meanwhile are made while waiting.
        session = self.session
        planner = self._get_planner() if batch is not None else None
        planning = planner is not None and planner.plans_itself
        session.emit("oom", **details, recovered=False, waiting=True, planning=planning)
        session.paused = True
        session.emit("paused", reason="oom")
        if planner is not None and planning:
            planner.oom(self._setting(oom.micro_batch), batch, shapes(batch), self._capacity())

        def apply() -> None:
            for control in self._apply_queued():
                if control.action in REMEDIES or control.action == "set_auto_recover":
                    if session.paused:
                        session.paused = False
                        session.emit("resumed", reason=control.action)
                    session.clear_rate()
            self._plan_paused(batch)

        apply()
        session.wait_while_paused(apply, self._stopping)
        return not self._stopping()

    # -- the planner ------------------------------------------------------------------------
    def _get_planner(self) -> Planner:
        if self.planner is None:
            self.planner = Planner(
                self.model,
                self.optimizer,
                self.step,
                self.device,
                tracked=isinstance(self.probe, CpuProbe),
                checkpoint_modules=self._checkpoint_modules,
                checkpointing_unavailable=self.checkpointing.unavailable(),
                blocks=len(self.checkpointing.blocks),
                min_micro_batch=self.sizing.floor,
                amp_unsupported=self.precision.unsupported,
                emit=self.session.emit,
                refuse=self.session.refuse,
                automatic=self._planning == "auto",
            )
        return self.planner

    def _plan_paused(self, batch: Any) -> None:
        """Paused (by the user, or at an OOM): a plan asked for is made at once on `batch`, the one the
        next step trains (no step waits on it)."""
        planner = self.planner
        if self.session.paused and planner is not None and planner.pending and batch is not None:
            self._shapes = shapes(batch)
            planner.work(self._setting(), batch, self._shapes, self.batch_size, self._capacity(), paused=True)

    def _setting(self, micro_batch: int | None = None) -> Setting:
        size = self._micro_batch() if micro_batch is None else micro_batch
        return Setting(size, self.precision.mode, self.checkpointing.enabled)

    def _capacity(self) -> int | None:
        return self._memory.capacity if self._memory is not None else self.probe.read().capacity

    def _plan_at_boundary(self, batch: Any) -> None:
        """The first batch of micro_batch="auto" starts at the largest micro-batch predicted to fit; a
        table asked for is traced here (a little each boundary), on the training thread."""
        if self._auto_micro_batch:
            self._auto_micro_batch = False
            self._choose_micro_batch(batch)
        planner = self.planner
        if planner is not None:
            self._shapes = shapes(batch)
            if planner.pending:
                planner.work(self._setting(), batch, self._shapes, self.batch_size, self._capacity())

    def _choose_micro_batch(self, batch: Any) -> None:
        """micro_batch="auto": the largest predicted to fit; the whole batch where nothing can say."""
        total = self.batch_size
        found, reason = self._auto_size(batch, total)
        self.micro_batch = None if found >= total else found
        details: dict[str, Any] = {"from": total, "to": found}
        self.session.emit("micro_batch_changed", **details, accumulation=self._accumulation(found), reason=reason)

    def _auto_size(self, batch: Any, total: int) -> tuple[int, str]:
        whole = "so the whole batch (OOM recovery will cut it)"
        capacity = self._capacity()
        if capacity is None:
            return total, f"auto: the device's capacity is unknown, {whole}"
        try:
            planner = self._get_planner()
            s = self._setting()
            found = planner.largest(s.amp, s.checkpointing, self.sizing.floor, total, batch, shapes(batch), capacity)
            if found is None:
                return self.sizing.floor, "auto: no micro-batch is predicted to fit, so the smallest"
            chosen = planner.prediction(self._setting(found), batch, shapes(batch))
        except NoPrediction:
            return total, f"auto: no prediction ({self._get_planner().untraceable(self._setting())}), {whole}"
        except Exception as exc:  # a bug of ours must not stop a run that would train
            return total, f"auto: the planner failed ({type(exc).__name__}: {exc}), {whole}"
        assert chosen is not None
        how = "predicted" if chosen.exact else "estimated"
        return (
            found,
            f"auto: {how} peak {format_bytes(planner.peak(chosen))} of {format_bytes(capacity)}, the largest that fits",
        )

    def _pick_after_oom(self, oom: OomInfo, batch: Any) -> tuple[int, str] | None:
        """The planner's micro-batch after an OOM; None (halve) when it cannot say. Never raises: a
        planner that fails must not turn a recoverable OOM into a crash."""
        capacity = self.probe.read().capacity
        if capacity is None:  # nothing to fit in: halve
            return None
        try:
            planner = self._get_planner()
            picked = planner.after_oom(self._setting(oom.micro_batch), batch, shapes(batch), capacity)
            planner.ask("oom")  # the whole table, at the next boundaries
            return picked
        except Exception as exc:  # a bug of ours or the model's code on fake tensors: halve as before
            self.session.emit("error", message=f"the planner failed, halving instead: {type(exc).__name__}: {exc}")
            return None

    # -- telemetry --------------------------------------------------------------------------
    def _watch_thrashing(self, retries: int) -> None:
        """The allocator retrying (freeing its whole cache, then allocating again) step after step
        is the slow road to an OOM; with auto-recover on, halve the micro-batch before it comes."""
        last, streak = self._retries
        streak = streak + 1 if retries > last else 0
        self._retries = (retries, streak)
        if self.dist is not None and streak >= THRASHING_STEPS:  # said at the exchange: every rank halves
            self._thrashing, self._retries = True, (retries, 0)
            return
        if streak >= THRASHING_STEPS and self.auto_recover and self.sizing.can_halve(self._micro_batch()):
            current = self._micro_batch()
            self.micro_batch = self.sizing.halved(current)
            self._retries = (retries, 0)
            self.session.emit(
                "thrashing",
                alloc_retries=retries,
                steps=streak,
                micro_batch=current,
                micro_batch_to=self.micro_batch,
                accumulation=self._accumulation(self.micro_batch),
            )

    def _publish(self) -> None:
        memory = self.session.publish(
            epoch=self.epoch,
            loss=self.loss,
            batch_size=self.batch_size,
            micro_batch=self._micro_batch(),
            accumulation=self.accumulation,
            amp=self.precision.mode,
            checkpointing=self.checkpointing.enabled,
            ranks=self.dist.ranks if self.dist is not None else (),
        )
        self._memory = memory
        self._baseline = memory.allocated or 0
        if memory.alloc_retries is not None:  # a caching allocator's count (CUDA)
            self._watch_thrashing(memory.alloc_retries)
        planner = self.planner
        near = memory.capacity and memory.peak and memory.peak >= NEAR_CAPACITY * memory.capacity
        if planner is not None or (near and not self._sharded):  # a sharded step cannot be traced
            self._calibrate(memory)
        if self.loss is not None and not math.isfinite(self.loss) and not self._warned_loss:
            self._warned_loss = True
            self.session.emit("loss_not_finite", loss=str(self.loss))

    def _calibrate(self, memory: Memory) -> None:
        """The step just measured against its prediction; near capacity, a table is made ahead."""
        planner = self._get_planner()
        setting, shape = self._setting(), self._shapes
        breakdown = {
            "parameters": memory.params or 0,
            "gradients": memory.params or 0,  # every trainable parameter has one at the peak
            "optimizer": memory.optimizer or 0,
        }
        breakdown["activations"] = max(0, (memory.peak or 0) - sum(breakdown.values()))
        planner.step_measured(setting, shape, memory.peak, breakdown)
        if planner.near_capacity(setting, shape, memory.peak, memory.capacity) and not planner.pending:
            planner.ask("near_capacity")

    def _counts(self, pieces: list[Any], size: int) -> tuple[list[int], int]:
        """Each piece's weight units and their sum: its samples, or with `items` what its loss is a mean
        over (so the pieces' weighted losses add up to the global batch's mean, whatever the padding)."""
        if self.items is None:
            counts = self.sizing.cut(self.batch_size, size)
        else:
            counts = [self._count(piece) for piece in pieces]
        return counts, sum(counts)

    def _count(self, batch: Any) -> int:
        """items(batch) as a count: an int, or a tensor of one integral value (read on the host batch)."""
        assert self.items is not None
        n = self.items(batch)
        try:
            value = float(n)  # an int, a NumPy integer, a one-element tensor
        except (TypeError, ValueError, RuntimeError):
            value = math.nan
        if isinstance(n, bool) or not (value >= 0 and value.is_integer()):
            shown = f"a tensor of shape {tuple(n.shape)}" if isinstance(n, torch.Tensor) else repr(n)[:80]
            raise FitError(f"items(batch) must return a count (an int >= 0, or a one-element tensor), got {shown}")
        return int(value)

    def _say_split(self, batch: Any, size: int) -> None:
        """Once a run each, the first time a batch is cut: what micro-batching changes for BatchNorm, and
        that a batch looking token-weighted has its pieces weighted by samples (without `items`)."""
        if not self._said_batch_norm:
            self._say_batch_norm(size)
        if not self._said_items:
            self._said_items = True
            hint = token_weighted(batch)
            if hint is not None:
                self.session.emit("items_hint", why=hint[0], fix=hint[1], micro_batch=size)

    def _say_batch_norm(self, size: int) -> None:
        """Once a run: micro-batching changes what BatchNorm computes, unlike every other remedy."""
        self._said_batch_norm = True
        self.session.emit(
            "batch_norm_micro_batched", layers=self.buffers.batch_norms, micro_batch=size, batch_size=self.batch_size
        )

    def _start(self) -> None:
        steps_per_epoch = _length(self.data)
        total = None
        if steps_per_epoch is not None and self.epochs is not None:
            total = steps_per_epoch * self.epochs
        if self.max_steps is not None:
            total = self.max_steps if total is None else min(total, self.max_steps)
        unavailable = self.checkpointing.unavailable()
        refused = {"set_checkpointing": unavailable} if unavailable else {}
        if self._planning == "off":
            refused["plan"] = 'planning="off": this run never traces its step'
        self.session.start(
            mode="fit",
            model=self.dist.model_name if self.dist is not None else type(self.model).__name__,
            refused=refused,
            epochs=self._planned_epochs(steps_per_epoch),
            max_steps=self.max_steps,
            steps_per_epoch=steps_per_epoch,
            total_steps=total,
            micro_batch=self.micro_batch,
            batch_norm=self.buffers.batch_norms,
            min_micro_batch=self.sizing.floor,
            amp=self.precision.mode,
            checkpointing=self.checkpointing.enabled,
            checkpointing_how=self.checkpointing.how,
            auto_recover=self.auto_recover,
            **(self.dist.identity() if self.dist is not None else {}),
        )

    def _planned_epochs(self, steps_per_epoch: int | None) -> int | None:
        if self.epochs is not None or not steps_per_epoch or self.max_steps is None:
            return self.epochs
        return math.ceil(self.max_steps / steps_per_epoch)

    def result(self) -> FitResult:
        return FitResult(
            rank=self.dist.rank if self.dist is not None else 0,
            world_size=self.dist.world_size if self.dist is not None else 1,
            steps=self.steps,
            epochs=self.epochs_done,
            samples=self.samples,
            micro_batch=self._micro_batch() if self.batch_size else self.micro_batch,
            loss=self._losses.last(),
            events=list(self.session.events or ()),
            stopped=self.stop_reason,
            amp=self.precision.mode,
            checkpointing=self.checkpointing.enabled,
            ooms_recovered=self.ooms_recovered,
            elapsed_s=self.session.elapsed(),
        )

    # -- Ctrl-C and SIGTERM: finish the step, then stop ---------------------------------------
    def _install_signals(self) -> Callable[[], None]:
        if threading.current_thread() is not threading.main_thread():
            return lambda: None  # the TUI's worker thread: the app handles keys, the runner signals
        names: dict[int, str] = {signal.SIGINT: "interrupted", signal.SIGTERM: "terminated"}
        previous = {sig: signal.getsignal(sig) for sig in names}

        first: list[float] = []

        def handler(signum: int, frame: Any) -> None:
            if self._signal is not None:  # the second one: stop now
                if self.dist is not None and time.monotonic() - first[0] < REPEATED_SIGNAL_S:
                    return  # torchrun passing on the Ctrl-C the terminal gave this rank already
                if signum == signal.SIGINT:
                    raise KeyboardInterrupt
                raise SystemExit(128 + signum)
            self._signal = names[signum]
            first.append(time.monotonic())
            # No lock may be taken in a handler (the interrupted code may hold it): write directly.
            again = f"again after {REPEATED_SIGNAL_S:g} s" if self.dist is not None else "again"
            sys.stderr.write(
                f"\ngputui: {self._signal}: finishing the current step, then stopping ({again} to stop at once)\n"
            )

        for sig in names:
            signal.signal(sig, handler)

        def restore() -> None:
            for sig, prev in previous.items():
                signal.signal(sig, prev)

        return restore
