"""One rank of several under DistributedDataParallel.

The rule that keeps a job from hanging: a rank handles an OOM alone only while it has issued no
collective in the step. Its pieces but the last run under no_sync(), then the last one's forward;
then the step's one exchange (exchange.py) says what every rank did; then the synced
backward (an OOM there is rescued: this rank completes the buckets the others wait for, and every
rank replays), the buffers' broadcast and optimizer.step().
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, nullcontext
from typing import Any, NamedTuple

import torch

from ...step.pieces import Progress
from ...telemetry.hub import Hub
from ..boundary import Boundary
from ..oom import Buffers, Generators, OomInfo, cudnn_error, drop, is_oom
from ..recovery import MAX_RETRIES, Recovery
from ..result import Agreed, Failure, FitError
from ..runner import Runner
from ..state import RunState
from .exchange import Agreement
from .waiting import Waiter
from .wrapper import Distributed

HasNext = Callable[[], bool]
"""Whether this rank has another batch after the step's: asked once the step trains (it reads ahead)."""

HEARTBEAT_S = 1.0
"""While paused, the ranks exchange this often (far within any process group's timeout)."""

PREVENT_AT = 0.9
"""Under FSDP, the share of its capacity a rank's step peak may reach before every rank halves."""


class Forwarded(NamedTuple):
    """A rank's share up to its synced backward: the last micro-batch's loss (None: out of memory
    after DDP's synced forward returned, `oom`), its items, the micro-batch count, the loss so far."""

    loss: torch.Tensor | None
    items: int
    pieces: int
    loss_sum: torch.Tensor | None
    oom: OomInfo | None


class Ddp:
    looks_ahead = True  # a step says whether every rank has another batch: each reads one ahead

    def __init__(
        self,
        group: Distributed,
        agreement: Agreement,
        hub: Hub,
        runner: Runner,
        recovery: Recovery,
        boundary: Boundary,
        state: RunState,
        generators: Generators,
        buffers: Buffers,
    ) -> None:
        self.group, self.agreement, self.hub = group, agreement, hub
        self.runner, self.recovery, self.boundary = runner, recovery, boundary
        self.state, self.generators, self.buffers = state, generators, buffers
        self.session = runner.session
        self._cooling = 0  # steps before the OOM prevention looks at the peaks again
        self._ooms_seen: dict[int, int] = {}  # every other rank's OOMs recovered, as the last exchange said
        agreement.wait = Waiter(
            group.rank,
            group.world_size,
            timeout_s=group.rank_timeout,
            stop_asked=self._stop_asked,
            said=self._waiting,
            unanswered=lambda ranks, waited, stop: recovery.unanswered(
                group.rank, ranks, waited, stop, group.rank_timeout
            ),
        ).wait

    @property
    def ranks(self) -> Any:
        return self.agreement.ranks

    def start(self) -> None:
        reason = self.recovery.no_budget_left()
        if reason:
            self.agreement.failure = Failure(reason, oom=True)  # said at the first exchange

    def set_epoch(self, epoch: int) -> None:
        self.group.set_epoch(epoch)  # a DistributedSampler shuffles by its epoch

    def batches(self, data: Iterable[Any], last: Callable[[], bool]) -> Iterator[tuple[Any, HasNext]]:
        """(this rank's batch or None once its data ran out, whether it has another): the next batch is
        read when the step's training begins (after its boundary: a stop there reads none), except for
        the run's last step (`last()`), so the exchange can say whether every rank has more."""
        end = object()
        batches = iter(data)
        batch = self._next(batches, end)
        while True:
            ahead: list[Any] = []

            def has_next(batch: Any = batch, ahead: list[Any] = ahead) -> bool:
                if not ahead:  # once a step, however many attempts ask
                    ahead.append(end if last() or batch is end else self._next(batches, end))
                return ahead[0] is not end

            yield (None if batch is end else batch), has_next
            has_next()
            batch = ahead[0]

    def _next(self, batches: Iterator[Any], end: object) -> Any:
        """The next batch; one the data cannot give (a worker's error) is this rank's failure, said at
        the exchange, instead of an exception the other ranks would wait on."""
        d = self.group
        if self.agreement.failure is not None:
            return end
        try:
            return next(batches, end)
        except Exception as exc:
            self.agreement.failure = Failure(
                f"{type(exc).__name__} on rank {d.rank} reading the data: {exc}", oom=False, error=exc
            )
            return end

    def end(self, epochs_done: int) -> None:
        """One closing exchange: a failure said after the last step (an optimizer.step() that failed
        there) reaches every rank, which raise FitError together."""
        self.group.set_epoch(epochs_done)  # a later fit on the same sampler goes on with the next shuffle
        agreed = self.agreement.exchange(items=None, has_next=False, stop=None)
        if agreed.fatal:
            raise self.recovery.job_error(self.agreement.failure, agreed, closing=True)

    # -- the boundary -----------------------------------------------------------------------
    def at_boundary(self, batch: Any) -> bool:
        """One rank's boundary: apply what the last exchange announced (every rank the same, so every
        rank the same state), then keep what was requested here for the next exchange. A stop, a
        signal or a control on one rank reaches the others there, one step later."""
        state = self.state
        self._align()
        self._prevent()
        self.boundary.apply_all(self.agreement.take_agreed())
        while self.session.paused and state.stop_reason is None:
            # Every rank paused at this boundary together: a heartbeat exchange a second keeps the
            # process group within its timeout and brings a resume, a stop or a control from any rank.
            self.hub.controls.wait(HEARTBEAT_S)
            self._queue_asked()
            self.exchange(here=True, has_next=True)
            self.boundary.apply_all(self.agreement.take_agreed())
        if state.stop_reason is not None:  # agreed at the last exchange
            return False
        self._queue_asked()
        return True

    def _align(self) -> None:
        """Every rank to the smallest micro-batch setting any rank had at the last exchange."""
        aligned = self.agreement.aligned()
        state = self.state
        if aligned is None or aligned[0] == state.micro_batch:
            return
        size, rank = aligned
        current = state.micro_batch_now()
        state.micro_batch = size
        new = state.micro_batch_now()
        if new != current:
            details: dict[str, Any] = {"from": current, "to": new, "accumulation": state.accumulation_at(new)}
            self.session.emit("micro_batch_changed", **details, reason=f"aligned with rank {rank}")

    def _prevent(self) -> None:
        """Halve every rank alike, from what the last exchange told every rank: when a rank's allocator
        thrashed (the slow road to an OOM; a rank halving alone would leave the others' passes and
        settings apart), and under FSDP, where an OOM mid-step ends the run, when a rank's step peak
        reached PREVENT_AT of its capacity. Then two steps pass before it looks again (the exchange's
        figures are a step late)."""
        if self._cooling:
            self._cooling -= 1
            return
        d, state = self.group, self.state
        if not state.auto_recover or not self.agreement.ranks:
            return
        shares = [(r.peak / r.capacity, r.rank) for r in self.agreement.ranks if r.peak is not None and r.capacity]
        share, rank = max(shares) if shares else (0.0, 0)
        if self.agreement.thrashing:
            reason = f"rank {self.agreement.thrashing[0]}'s allocator thrashing (retrying allocations step after step)"
        elif d.fsdp and share >= PREVENT_AT:
            reason = f"rank {rank}'s step peak at {share:.0%} of its capacity (under FSDP an OOM ends the run)"
        else:
            return
        current, _ = self.agreement.job_sizes()
        if not state.sizing.can_halve(current):
            return
        new = state.sizing.halved(current)
        state.micro_batch, self._cooling = new, 2
        self.agreement.resized(new)
        details: dict[str, Any] = {"from": current, "to": new, "accumulation": state.accumulation_at(new)}
        self.session.emit("micro_batch_changed", **details, reason=reason)

    def _stop_asked(self) -> str | None:
        """A stop asked of this rank while it waits for the others: a signal, or the stop control
        (which the boundary would drain; a rank that waits reaches none)."""
        return self.boundary.signalled() or ("requested" if self.hub.controls.has("stop") else None)

    def _waiting(self, ranks: list[int], waited: float) -> None:
        self.session.emit("rank_waiting", ranks=ranks, at=self.state.steps + 1, waited_s=round(waited))

    def _queue_asked(self) -> None:
        """Controls asked of this rank: for the next exchange (what this run refuses, answered now)."""
        outgoing = []
        for control in self.hub.controls.drain():
            if control.action in self.session.refused:
                self.session.apply(control)  # refused with its reason, here and now
            else:
                outgoing.append(control)
        self.agreement.queue(outgoing)

    def exchange(self, *, here: bool, has_next: bool) -> Agreed:
        """The exchange with what this rank says: its batch (`here`), a signal, its micro-batch and
        batch, its last step's peak and capacity. A stop agreed there is this rank's from now on."""
        d, state, recovery = self.group, self.state, self.recovery
        signalled = self.boundary.signalled()
        memory, latest = state.memory, self.hub.latest()
        agreed = self.agreement.exchange(
            items=state.units if here else None,
            has_next=has_next,
            stop=signalled,
            micro_batch=state.micro_batch_now() if here else None,
            setting=state.micro_batch,
            batch=state.batch_size if here else None,
            peak=memory.peak if memory is not None else None,
            capacity=memory.capacity if memory is not None else None,
            loss=state.loss,
            samples_per_s=latest.samples_per_s if latest is not None else None,
            ooms=state.ooms_recovered,
            thrashing=recovery.thrashing,
        )
        recovery.thrashing = False  # said
        if agreed.stop is not None and state.stop_reason is None:
            state.stop_reason = signalled or agreed.stop
        for (
            r
        ) in self.agreement.ranks:  # another rank's OOM, recovered alone: said here too (each screen shows one rank)
            if r.rank != d.rank and r.ooms > self._ooms_seen.get(r.rank, 0):
                self.session.emit("rank_oom_recovered", rank=r.rank, ooms=r.ooms, micro_batch=r.micro_batch)
            self._ooms_seen[r.rank] = r.ooms
        return agreed

    # -- one global batch -------------------------------------------------------------------
    def train(self, batch: Any, has_next: HasNext) -> bool | None:
        """Train this rank's share of a global batch (None: its data ran out). True: every rank has
        another batch this epoch. An OOM before the exchange (a forward, a no_sync backward) is this
        rank's alone: it replays its share at the planner's pick (or half) while the others wait in
        the exchange. An OOM in the synced backward is replayed by every rank (the failing one at its
        pick); the next boundary brings every rank to the smallest pick. What cannot be recovered ends
        the run on every rank (FitError)."""
        d, recovery = self.group, self.recovery
        more = has_next()
        self.generators.start()
        self.buffers.save()
        attempt = 0
        try:
            while True:
                attempt += 1
                last = None
                while self.agreement.failure is None and batch is not None:
                    outcome = self._forward(batch)
                    if not isinstance(outcome, OomInfo):
                        last = outcome
                        break
                    if d.prepared is not None:  # past DDP's synced forward: every rank must see it through
                        last = Forwarded(None, 0, 0, None, outcome)
                        break
                    recovery.drop_step()  # this rank's no_sync gradients, draws and running statistics
                    said = recovery.alone(outcome, attempt, d.rank, batch)
                    if said is not None:
                        self.agreement.failure = Failure(said, oom=True)
                    attempt += 1
                agreed = self.exchange(here=batch is not None, has_next=more)
                if agreed.fatal or not agreed.all_have_batch:
                    recovery.drop_step()
                    raise recovery.job_error(self.agreement.failure, agreed)
                assert last is not None
                done, oom = self._synced(agreed, last, attempt)
                d.rebuild_buckets()
                if done:
                    return agreed.all_have_next
                recovery.drop_step()  # every rank: the step's gradients, draws and running statistics
                if oom is not None:  # the planner's pick for this rank's share, or half (_synced checked it can)
                    recovery.recover(oom, attempt, batch)
        finally:
            self.generators.end()

    def _forward(self, batch: Any) -> Forwarded | OomInfo | None:
        """Every micro-batch under no_sync() but the last, and the last one's forward: nothing
        collective. Returns the OOM when this rank ran out of memory (it replays alone unless
        d.prepared says DDP's synced forward returned before it); None when it failed otherwise
        (self.agreement.failure says how)."""
        d, runner, state = self.group, self.runner, self.state
        size = state.micro_batch_now()
        runner.start(batch, size)
        pieces = runner.cut(batch, size)
        at = Progress()
        d.prepared = None
        try:
            counts, state.units = runner.counts(pieces, size)  # weighted by this rank's share until the exchange
            units = state.units
            loss_sum, loss = runner.run(pieces, counts, units, lambda n: n / units, at, sync=self._sync, hold_last=True)
            return Forwarded(loss, counts[-1], len(pieces), loss_sum, None)
        except Exception as exc:
            if is_oom(exc):
                return self.recovery.caught(exc, at.phase, size)
            message = str(cudnn_error(exc) or exc)
            if d.ours and "find_unused_parameters" in message:  # DDP's advice names a constructor fit called
                from .wrapper import UNUSED

                message = f"{UNUSED} [{message.splitlines()[0]}]"
            if not isinstance(exc, FitError):
                message = f"{type(exc).__name__} on rank {d.rank}, step {state.steps + 1}: {message}"
            self.agreement.failure = Failure(message, oom=False, error=exc)
        return None

    def _sync(self, last: bool) -> AbstractContextManager[Any]:
        return nullcontext() if last else self.group.model.no_sync()

    def _synced(self, agreed: Agreed, last: Forwarded, attempt: int) -> tuple[bool, OomInfo | None]:
        """The last backward (DDP all-reduces its buckets), then the step. DDP averages the ranks'
        gradients; scaled by world_size * (this rank's items) / (all ranks' items), the average is
        the gradient of the mean loss over the global batch (its samples, or its `items`), uneven
        shards included."""
        d, runner, state, recovery = self.group, self.runner, self.state, self.recovery
        world = d.world_size
        loss, n, count, loss_sum = last.loss, last.items, last.pieces, last.loss_sum
        if not agreed.items:  # the same on every rank: all raise here, before any collective
            recovery.drop_step()
            raise recovery.no_items(everywhere=True)
        scale = world * state.units / agreed.items
        if count > 1 and scale != 1:  # the no_sync micro-batches were weighted by this rank's share alone
            for group in runner.optimizer.param_groups:
                grads = [p.grad for p in group["params"] if p.grad is not None]
                if grads:
                    torch._foreach_mul_(grads, scale)
        d.begin_synced()
        failed, oom = last.oom, True
        weighted = None
        if loss is not None:
            weighted = loss * (world * n / agreed.items)
            try:
                runner.backward(weighted)
            except Exception as exc:
                oom = is_oom(exc)
                message = drop(exc) if oom else f"{type(exc).__name__}: {drop(exc)}"
                failed = OomInfo("backward", message, state.micro_batch_now(), state.baseline)
        fatal = False
        if failed is not None:
            halvable = state.sizing.can_halve(failed.micro_batch)
            fatal = not (oom and state.auto_recover and halvable and attempt <= MAX_RETRIES)
            if not d.failed_synced(fatal):  # after its gradients went out: the others step on them
                recovery.drop_step()
                self.agreement.failure = Failure(
                    f"{failed.message} after the synced backward on rank {d.rank}", oom=oom
                )
                return False, None  # said at the next exchange, where every rank stops
            # What the zeros must reach, then the failed graph let go before they are allocated: this
            # rank has just run out of memory.
            reached = d.reached([weighted] if weighted is not None else d.prepared or [])
            loss = weighted = d.prepared = None
            del last
            runner.probe.free_cache()
            self._complete_buckets(reached, failed.message)
        else:
            del last
        del loss
        d.prepared = None
        failures, fatals, ranks = d.agree_valid()
        if failures:
            del weighted
            if not fatals:
                return False, failed
            recovery.drop_step()
            if failed is not None:
                raise recovery.synced_failure(failed, fatal, d.rank)
            raise recovery.others_failed(ranks)
        assert weighted is not None
        runner.piece_done()
        local = weighted.detach().float() / scale if scale else weighted.detach().float()  # this rank's mean
        loss_sum = local if loss_sum is None else loss_sum + local
        del weighted
        d.broadcast_buffers()
        try:
            runner.optimizer_step()
        except Exception as exc:
            # Not safe to retry (the parameters may be partly updated) and the others have stepped:
            # this rank ends the step as they do and says it at the next exchange (or the closing
            # one), where every rank raises FitError together.
            message, was_oom = recovery.optimizer_failed(exc, d.rank)
            self.agreement.failure = Failure(message, oom=was_oom, error=None if was_oom else exc)
        runner.done(loss_sum, count)
        return True, None

    def _complete_buckets(self, reached: set[int] | None, message: str) -> None:
        """The synced step failed here: finish DDP's reduction with zeros so no rank is left in it
        (the memory budget is lifted meanwhile: those gradients were counted against it already)."""
        tracker = self.runner.tracker
        budget = tracker.budget if tracker is not None else None
        if tracker is not None:
            tracker.budget = None
        try:
            self.group.complete_buckets(reached)
        except Exception as exc:
            raise self.recovery.buckets_failed(message, self.group.rank, exc) from None
        finally:
            if tracker is not None:
                tracker.budget = budget

    def close(self) -> None:
        self.group.close()
