"""The core of a run: its parts, wired. Each part owns its state and its one job:

    RunState      the setting and counters every part reads (engine/state.py)
    Runner        a piece's forward and backward, the optimizer step, the step's end (runner.py)
    Boundary      the controls, the pause, the stop a control or a signal asks for (boundary.py)
    Recovery      what follows an OOM; the words a run ends with (recovery.py, endings.py)
    PlanningHook  the planner, made when first needed (planhook.py)
    a strategy    one process, DDP or FSDP: how a global batch is trained, its collectives (strategies/)

`step(batch)` trains one global batch: the boundary, the planner's turn, the strategy, its record.
fit() (engine/fit.py) is a loop over it inside `running()`; gputui.Trainer (trainer.py) hands it to
the script's own loop. A process's cores are one run (continuity.py): each takes up what the one
before it left.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Callable, Iterator
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..probes.cpu import hidden_from_dynamo
from ..step.checkpointing import Checkpointing
from ..step.microbatch import batch_size
from ..step.precision import Precision
from ..step.sizing import Sizing
from ..telemetry.controls import BATCH_NORM_FLOOR
from ..telemetry.hub import IDLE_S
from ..telemetry.setup import MetricsSink, for_process
from .boundary import Boundary
from .continuity import SettingNow, carried
from .deferred import DeferredLoss
from .oom import Buffers, Generators
from .options import FitOptions, is_shared, resolve_device
from .planhook import PlanningHook
from .recovery import Recovery, run_past_failures
from .result import FitError, FitResult
from .runner import Runner
from .session import RunSession
from .state import RunState
from .strategies.single import Single

if TYPE_CHECKING:  # imported where a run is distributed
    from .strategies.exchange import Agreement
    from .strategies.wrapper import Distributed


def _ANOTHER() -> bool:
    return True


def _check_arguments(model: Any, step: Any, optimizer: Any) -> None:
    """fit's three arguments, each of its kind. An optimizer made for another model (the model rebuilt or
    reloaded after it) would step nothing of this one, and its gradients would pile up: said before the
    run, not found after it."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not callable(step):
        raise TypeError("step must be a function step(model, batch) -> loss")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    if trainable and not trainable & held:
        raise ValueError(
            f"the optimizer holds none of the model's {len(trainable)} trainable parameters: make it after the "
            "model, from its parameters (torch.optim.AdamW(model.parameters())), or after the model is rebuilt"
        )


def _group(
    model: nn.Module,
    device: torch.device,
    data: Any,
    checkpointing: Checkpointing,
    optimizer: torch.optim.Optimizer,
    o: FitOptions,
) -> tuple[Distributed, Agreement]:
    """Under torchrun: the process group the model is wrapped (DDP) or sharded (FSDP2) in, and the
    ranks' agreement on each step's exchange."""
    from .strategies.exchange import Agreement
    from .strategies.wrapper import Distributed

    group = Distributed(
        model,
        device,
        data,
        shard=o.distributed == "fsdp",
        blocks=checkpointing.blocks,
        optimizer=optimizer,
        rank_timeout=o.rank_timeout,
    )
    return group, Agreement(group.rank, group.world_size, group.exchange_group, group.closing_group)


class Core:
    def __init__(
        self,
        model: nn.Module,
        step: Callable[[nn.Module, Any], torch.Tensor],
        optimizer: torch.optim.Optimizer,
        o: FitOptions,
        data: Any = None,
    ) -> None:
        _check_arguments(model, step, optimizer)
        hub = for_process(sys.stdout)  # the installed hub; under plain `python script.py`, one of its own
        self.hub = hub
        shared = is_shared(o.distributed, model)
        if shared:
            from .strategies.group import device_for

            device = resolve_device(device_for(o.device))
        else:
            device = resolve_device(o.device)
        self.device = device
        precision = Precision(device, o.amp)
        generators = Generators(device)
        checkpointing = Checkpointing(model, o.checkpoint_modules)
        reason = checkpointing.unavailable()
        if o.checkpointing and reason:
            raise ValueError(f"checkpointing=True, but {reason}")
        model.to(device)
        group, agreement = _group(model, device, data, checkpointing, optimizer, o) if shared else (None, None)
        if group is not None:
            model = group.model
        self.user_model = model  # the script's, whatever wraps it: what a setting carried over belongs to
        self.model, self.group = model, group
        model.train()  # before Buffers: a train() override may keep BatchNorm layers in eval mode
        buffers = Buffers(model)
        # BatchNorm normalizes over the micro-batch: one sample has no variance (and is an error)
        sizing = Sizing(2 if buffers.batch_norms else 1)
        if isinstance(o.micro_batch, int) and o.micro_batch < sizing.floor:
            raise ValueError(
                f"micro_batch={o.micro_batch}, but the model has BatchNorm layers and "
                f"{BATCH_NORM_FLOOR}: use 2 or more, or GroupNorm/LayerNorm instead"
            )
        # Last, after every check that can fail: the script's own metrics file (unless the command
        # line named one), and the tracker, which hooks the parameters until the run ends.
        self._metrics = MetricsSink(hub, o.metrics if hub.overrides.metrics is None else None)
        try:
            session = RunSession(
                hub,
                device,
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
        if session.tracker is not None:
            checkpointing.on_inputs = hidden_from_dynamo(session.tracker.note_saved)
        if o.checkpointing is not None:
            checkpointing.set(o.checkpointing)
        self.session, self.precision = session, precision
        self.checkpointing, self.generators = checkpointing, generators
        self.buffers, self.optimizer = buffers, optimizer
        session.replay_state = lambda: [*generators.kept(), *(buffers.saved or ())]  # the top tensors' gputui replay
        self.state = state = RunState(
            session,
            sizing,
            # A cap: None means the whole global batch; "auto": the largest predicted to fit, at the first batch.
            micro_batch=o.micro_batch if isinstance(o.micro_batch, int) else None,
            auto_recover=o.auto_recover,
            baseline=session.probe.allocated(),
            clip_grad_norm=o.clip_grad_norm,
            grad_norms=DeferredLoss.for_device(device),
        )
        self.planning = PlanningHook(
            model,
            optimizer,
            step,
            device,
            precision,
            checkpointing,
            o.checkpoint_modules,
            session,
            state,
            auto_micro_batch=o.micro_batch == "auto",
            mode=o.planning,
            traceable=group is None or not group.fsdp,
        )
        self.boundary = Boundary(hub, session, state, precision, checkpointing, self.planning, agreement)
        self.recovery = Recovery(
            optimizer, generators, buffers, session, state, self.boundary, self.planning, shared=group is not None
        )
        self.runner = Runner(
            model, step, optimizer, o.scheduler, o.items, device, precision, checkpointing, buffers, session, state
        )
        parts = (self.runner, self.recovery, self.boundary, state, generators, buffers)
        if group is None or agreement is None:
            self.strategy: Any = Single(*parts)
        else:
            from .strategies.ddp import Ddp
            from .strategies.fsdp import Fsdp

            self.strategy = (Fsdp if group.fsdp else Ddp)(group, agreement, hub, *parts)
        self._at_boundary, self._train = self.strategy.at_boundary, self.strategy.train  # bound once
        self.more = True  # under torchrun: whether every rank has another batch, as the last step said
        self._warned_loss = False
        self._options = o
        given = (o.micro_batch, o.amp, o.checkpointing)
        self.setting = SettingNow(state, precision, checkpointing, self.planning, given)
        self.carried = carried(hub)
        self._take_up()
        # The process's steps and samples before this run's: its own are counted from here.
        self.first_step, self.first_samples = session.steps, session.samples
        self.by = "fit"  # what drives this run: fit, or gputui.Trainer (the script's loop)

    def _take_up(self) -> None:
        """Continue the process's run: its counters, a stop asked for, auto-recover, and for the same
        model the setting and the planner's predictions it ended with (continuity.py)."""
        c, state, session = self.carried, self.state, self.session
        session.steps, session.samples = c.steps, c.samples
        state.stop_reason = c.stop_reason
        if c.auto_recover is not None:
            state.auto_recover = c.auto_recover
        self.setting.take_up(c.setting_for(self.user_model))

    # -- one global batch -------------------------------------------------------------------
    def step(self, batch: Any, has_next: Any = None) -> bool:
        """Train one global batch (None: this rank's data ran out, the others' not yet): the boundary,
        the planner's turn, the strategy, the step's record. False: stopped before it was trained.
        `has_next`: under torchrun, what says whether this rank has another batch (strategies/ddp.py);
        the script's own loop (gputui.Trainer) says nothing: each rank has another until its loop ends."""
        state, hub = self.state, self.hub
        idle = hub.idle_since
        if idle is not None and time.time() - idle >= IDLE_S:
            hub.clear_rate()  # an evaluation, a save: not training time
        hub.idle_since = None
        if batch is not None:
            state.batch_size = batch_size(batch)
        if not self._at_boundary(batch):
            return False
        if batch is not None:
            self.planning.at_boundary(batch)
        more = self._train(batch, has_next if has_next is not None else _ANOTHER)
        hub.idle_since = now = time.time()
        if more is None:
            return False
        self.more = more
        self._publish(now)
        return True

    def stop_asked(self) -> str | None:
        """After a step of the script's own loop: why the run stops, if a stop came during the step (a key,
        a signal), so the loop leaves now rather than at the next step's boundary. Under torchrun a stop
        is the job's, agreed at a boundary: the next step() says it."""
        if self.group is None:
            if self.hub.controls.has("stop"):
                self.boundary.apply_queued()
            self.boundary.stopping()
        return self.state.stop_reason

    def _publish(self, t: float) -> None:
        state = self.state
        memory = self.session.publish(
            t,
            epoch=state.epoch,
            loss=state.loss,
            batch_size=state.batch_size,
            micro_batch=state.micro_batch_now(),
            accumulation=state.accumulation,
            amp=self.precision.mode,
            checkpointing=self.checkpointing.enabled,
            ranks=self.strategy.ranks,
            grad_norm=state.grad_norm,
            exact=self.planning.planner is not None or self.group is not None,  # the ranks halve on each step's peak
        )
        loss = state.loss
        nothing = self.group is not None and not state.units  # a rank whose share had no items: its loss means nothing
        if loss is not None and not math.isfinite(loss) and not self._warned_loss and not nothing:
            self._warned_loss = True
            self.session.emit("loss_not_finite", loss=str(loss))
        if memory is None:  # no new reading after this step: the last one stands
            return
        state.baseline = memory.allocated or 0
        if memory.alloc_retries is not None:  # a caching allocator's count (CUDA)
            self.recovery.watch_thrashing(memory.alloc_retries, self.session.steps)
        self.planning.after_step(memory)

    # -- the run ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def running(self, **length: Any) -> Iterator[None]:
        """The run around the steps: its start record (`length`: epochs, steps), the signals, and
        whatever ends it (the stop said, the error said and given the result, the model left as
        it came, the end record)."""
        with self._metrics:
            held = self.state.stop_reason  # a stop asked for in an earlier run: said then
            self._start(length)
            restore_signals = self.boundary.install_signals()
            error: str | None = None
            raised: BaseException | None = None
            try:
                self.optimizer.zero_grad(set_to_none=True)
                if self.session.tracker is not None:
                    self.session.tracker.reset()
                self.strategy.start()
                yield
                if self.state.stop_reason and not held:
                    self.session.emit("stopped", reason=self.state.stop_reason)
            except FitError as exc:
                error, raised = str(exc), exc
                exc.result = self.result(waits=False)
                raise
            except BaseException as exc:
                error, raised = self.boundary.error_of(exc), exc  # None: a stop (the script's sys.exit(0))
                raise
            finally:
                if error is not None:
                    self.session.emit("error", message=error)
                ends = (
                    restore_signals,  # first: a second Ctrl-C in what follows is the script's again
                    partial(self.planning.abandon, "the run ended before the plan was complete"),
                    self.generators.close,
                    self.checkpointing.remove,
                    self.strategy.close,
                    self.session.close,
                    self.state.grad_norms.last,  # the last steps' norms: a skipped one is said before the end
                    partial(self._end, error),
                )
                if raised is None:
                    for end in ends:
                        end()
                else:  # the error stays the one raised, and the run's end is said (the metrics file's end line)
                    run_past_failures(ends, raised, "end the run cleanly")

    def _end(self, error: str | None) -> None:
        """The run's part ends; the process's run goes on until the script ends (continuity.py)."""
        summary = self.result(waits=error is None).summary(error)
        self.session.emit("part_ended", by=self.by, steps=summary.steps, samples=summary.samples)
        self._metrics.end(summary)
        state, session = self.state, self.session
        auto_recover = state.auto_recover if state.auto_recover != self._options.auto_recover else None
        self.carried.auto_recover = auto_recover if auto_recover is not None else self.carried.auto_recover
        self.carried.keep(self.user_model, self.setting.changed(), summary, error, (session.steps, session.samples))
        self.hub.idle_since = time.time()

    def _start(self, length: dict[str, Any]) -> None:
        unavailable = self.checkpointing.unavailable()
        refused = {"set_checkpointing": unavailable} if unavailable else {}
        if self.planning.off:
            refused["plan"] = 'planning="off": this run never traces its step'
        group = self.group
        if not self.carried.begin(self.hub):
            self.session.continued(
                model=group.model_name if group is not None else type(self.model).__name__,
                refused=refused,
                **length,
                micro_batch=self.state.micro_batch,
                amp=self.precision.mode,
                checkpointing=self.checkpointing.enabled,
                auto_recover=self.state.auto_recover,
            )
            return
        self.session.start(
            mode="fit",
            model=group.model_name if group is not None else type(self.model).__name__,
            refused=refused,
            **length,
            micro_batch=self.state.micro_batch,
            batch_norm=self.buffers.batch_norms,
            min_micro_batch=self.state.sizing.floor,
            amp=self.precision.mode,
            checkpointing=self.checkpointing.enabled,
            checkpointing_how=self.checkpointing.how,
            auto_recover=self.state.auto_recover,
            clip_grad_norm=self.state.clip_grad_norm,
            **(group.identity() if group is not None else {}),
        )

    def result(self, waits: bool = True) -> FitResult:
        """The figures so far; not `waits` (after an error): the last loss read if the device answers no wait."""
        state, group, losses = self.state, self.group, self.runner.losses
        return FitResult(
            rank=group.rank if group is not None else 0,
            world_size=group.world_size if group is not None else 1,
            steps=state.steps - self.first_step,
            epochs=state.epochs_done,
            samples=state.samples - self.first_samples,
            micro_batch=state.micro_batch_now() if state.batch_size else state.micro_batch,
            loss=losses.last() if waits else losses.last_or_latest(),
            events=[e for e in self.session.events or () if e.name != "part_ended"],  # the return itself
            stopped=state.stop_reason,
            amp=self.precision.mode,
            checkpointing=self.checkpointing.enabled,
            ooms_recovered=state.ooms_recovered,
            elapsed_s=self.session.elapsed(),
        )
