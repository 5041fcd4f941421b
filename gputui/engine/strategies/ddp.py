"""One rank of several under DistributedDataParallel.

The rule that keeps a job from hanging: a rank handles an OOM alone only while it has issued no
collective of the step's gradients. A step meets the other ranks once, in DDP's gradient all-reduce,
where it can: under fit's own DDP on gloo, once an exchange has told every rank the global batch
(the run's first step, and after an epoch ends), a step exchanges only when some rank marked its
last bucket (verdict.py), after the synced backward; what that exchange decides applies at the next
boundary, and a global batch whose size changed is put right there (its gradients rescaled).
Otherwise (the first step, `items`, a script's DDP, NCCL) the step's exchange (exchange.py) starts as
the step does and is waited for before the synced backward. Either way an OOM in the synced backward
is rescued (this rank completes the buckets the others wait for, and every rank replays; a rank that
can no longer train completes them too, and every rank stops), then the buffers' broadcast and
optimizer.step().
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any, NamedTuple

import torch

from ...step.pieces import Progress
from ..oom import OomInfo, cudnn_error, drop, is_oom
from ..recovery import MAX_RETRIES
from ..result import Agreed, Failure, FitError
from .group import abandon, is_transport, lost_ranks
from .rank import HasNext, Rank
from .wrapper import UNUSED

ROWS_S = 1.0
"""Under quiet steps, the ranks' rows (memory, loss, speed) travel about this often: an exchange every
so many steps, as rank 0 proposes from its step rate."""
MAX_EVERY = 1000
FIRST_EVERY = 8
"""Before rank 0 knows its step rate (the run's first exchange)."""


class Forwarded(NamedTuple):
    """A rank's share up to its synced backward: the last micro-batch's loss (None: out of memory
    after DDP's synced forward returned, `oom`), its items, the micro-batch count, the loss so far."""

    loss: torch.Tensor | None
    items: int
    pieces: int
    loss_sum: torch.Tensor | None
    oom: OomInfo | None


class Ddp(Rank):
    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        d = self.group
        # Quiet steps need the marker and a global batch that only changes when a rank says so.
        self._can_quiet = d.marker is not None and d.can_rescue and self.runner.items is None
        self._quiet = False  # this step exchanges nothing before its synced backward (the same on every rank)
        self._assumed: Agreed | None = None  # what the last exchange said, for a quiet step
        self._all_have_next = True
        # This rank's batch, micro-batch setting and OOMs as the last exchange said them.
        self._said: tuple[int, int | None, int] = (0, None, 0)
        self._saying: tuple[int, int | None, int] = self._said
        self._exchanged_at = 0  # the step of the last exchange
        self._every = 1

    # -- one global batch -------------------------------------------------------------------
    def train(self, batch: Any, has_next: HasNext) -> bool | None:
        """Train this rank's share of a global batch (None: its data ran out). True: every rank has
        another batch this epoch. An OOM before the synced backward (a forward, a no_sync backward) is
        this rank's alone: it replays its share at the planner's pick (or half) while the others wait
        in the synced backward. An OOM in the synced backward is replayed by every rank (the failing one at its
        pick); the next boundary brings every rank to the smallest pick. What cannot be recovered ends
        the run on every rank (FitError)."""
        d, recovery = self.group, self.recovery
        more = has_next()
        self._all_have_next = True  # unless an exchange in this step says otherwise
        if self._quiet and batch is None:  # its data ended with no word from the step before: said, as a failure
            self.agreement.failure = Failure(f"rank {d.rank}'s data ended before the others'", oom=False)
        self.generators.start()
        if self.buffers.live:  # most models have no running statistics: no call a step
            self.buffers.save()
        attempt = 0
        try:
            while True:
                attempt += 1
                last = None
                quiet = self._quiet  # as the last exchange left it: the same on every rank
                early = d.can_rescue and not quiet  # the exchange goes on while this rank runs its forwards
                if batch is not None and (early or quiet):
                    self._count_share(batch)
                if early:
                    self.start_exchange(here=batch is not None, has_next=more, every=self._every_proposal())
                told = not quiet and self.agreement.failure is not None  # in the exchange under way
                while self.agreement.failure is None and batch is not None:
                    outcome = self._forward(batch, quiet)
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
                if quiet:
                    assert self._assumed is not None
                    agreed = self._assumed
                else:
                    if not early:
                        self.start_exchange(here=batch is not None, has_next=more, every=self._every_proposal())
                    agreed = self._exchanged(self.finish_exchange())
                    if agreed.fatal or not agreed.all_have_batch:
                        recovery.drop_for(self.agreement.failure)
                        raise recovery.endings.job_error(self.agreement.failure, agreed)
                if self.agreement.failure is not None and not told:  # after the exchange went out, or none did
                    raise self._failed_before_synced(agreed, more, quiet)
                assert last is not None
                done, oom = self._synced(agreed, last, attempt, more, quiet)
                d.rebuild_buckets()
                if done:
                    return self._all_have_next
                recovery.drop_for(self.agreement.failure)  # every rank: the step's gradients, draws, statistics
                if oom is not None:  # the planner's pick for this rank's share, or half (_synced checked it can)
                    recovery.recover(oom, attempt, batch)
        finally:
            self.generators.end()

    def _news(self, more: bool) -> bool:
        """Whether this rank has something to say after a quiet step's synced backward: a control, a stop
        or a failure; its data ending; its batch, micro-batch setting or OOMs since the last exchange;
        or the rows due (a step count, the same on every rank)."""
        state = self.state
        return (
            self.agreement.has_news
            or not more
            or self.boundary.signalled() is not None
            or self.recovery.thrashing
            or (state.units, state.micro_batch, state.ooms_recovered) != self._said
            or state.steps - self._exchanged_at >= self._every
        )

    def start_exchange(self, *, here: bool, has_next: bool, **verdict: Any) -> None:
        """As Rank's, keeping what this rank says: what differs from it at a quiet step is news."""
        state = self.state
        self._saying = (state.units, state.micro_batch, state.ooms_recovered)  # what changes later is news
        super().start_exchange(here=here, has_next=has_next, **verdict)

    def _exchanged(self, agreed: Agreed) -> Agreed:
        """What an exchange of this step told every rank, kept for the quiet steps after it."""
        state = self.state
        self._all_have_next = agreed.all_have_next
        self._said = self._saying
        self._exchanged_at = state.steps
        self._every = min(max(agreed.every, 1), MAX_EVERY)
        self._quiet = self._can_quiet and agreed.all_have_next and agreed.items > 0 and not agreed.fatal
        self._assumed = Agreed(agreed.items, True, True, 0, 0, [], None)
        return agreed

    def _every_proposal(self) -> int:
        """Rank 0's: about ROWS_S of steps at its current rate (the others say 0)."""
        if self.group.rank != 0:
            return 0
        latest = self.hub.latest()
        rate = latest.steps_per_s if latest is not None else None
        return max(1, min(MAX_EVERY, int(ROWS_S * rate))) if rate else FIRST_EVERY

    def _verdict(self, more: bool, quiet: bool, assumed: int) -> tuple[int, int, list[int], Agreed | None]:
        """After the synced backward: (ranks whose backward failed, of which cannot go on, the failing
        ranks, the exchange's word if there was one). With the marker, an exchange only when some rank
        marked: it carries the verdicts, puts the marked element back and, on a quiet step whose global
        batch changed, rescales the gradients to it (`assumed`: the items they were weighted for)."""
        d = self.group
        m = d.marker
        if m is None:
            return (*d.agree_valid(), None)
        if not m.sent:  # the bucket of a parameter that got no gradient never went out
            raise FitError(f"rank {d.rank}: {UNUSED}")
        if not m.heard:
            return 0, 0, [], None
        failed, fatal = d.failed
        self.start_exchange(
            here=True,
            has_next=more,
            failed=bool(failed),
            failed_fatal=bool(fatal),
            marker=m.value,
            every=self._every_proposal(),
        )
        agreed = self._exchanged(self.finish_exchange())
        d.put_back(agreed.marker)
        if quiet and not agreed.failed and agreed.items != assumed:  # weighted for the batch the last exchange said
            grads = [p.grad for p in d.params if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, assumed / agreed.items)
        return agreed.failed, agreed.failed_fatal, agreed.failed_ranks, agreed

    def _failed_before_synced(self, agreed: Agreed, more: bool, quiet: bool) -> FitError:
        """This rank cannot train its share, and the exchange went out before it knew (or a quiet step
        had none): the others are in the synced backward. It completes DDP's buckets with zeros, its
        verdict saying it cannot go on, so every rank drops the step and stops there."""
        d, recovery = self.group, self.recovery
        failure = self.agreement.failure
        assert failure is not None
        d.begin_synced(mean=not quiet)
        d.failed_synced(fatal=True)
        d.expect_backward()
        recovery.drop_for(failure)
        self._complete_buckets(None, failure.message)
        told = self._verdict(more, quiet, agreed.items)[3]  # the others read theirs: this one's says what they do
        return recovery.endings.job_error(failure, told or agreed)

    def _forward(self, batch: Any, quiet: bool) -> Forwarded | OomInfo | None:
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
            # A quiet step's pieces are weighted for the global batch the last exchange said (its buckets
            # summed); otherwise for this rank's share, rescaled once the exchange says the global batch.
            total = self._assumed.items if quiet and self._assumed is not None else units
            loss_sum, loss = runner.run(pieces, counts, units, lambda n: n / total, at, sync=self._sync, hold_last=True)
            return Forwarded(loss, counts[-1], len(pieces), loss_sum, None)
        except Exception as exc:
            if is_oom(exc):
                return self.recovery.caught(exc, at.phase, size)
            message = str(cudnn_error(exc) or exc)
            if d.ours and "find_unused_parameters" in message:  # DDP's advice names a constructor fit called
                message = f"{UNUSED} [{message.splitlines()[0]}]"
            if not isinstance(exc, FitError):
                message = f"{type(exc).__name__} on rank {d.rank}, step {state.steps + 1}: {message}"
            self.agreement.failure = Failure(message, oom=False, error=exc)
        return None

    def _sync(self, last: bool) -> AbstractContextManager[Any]:
        return nullcontext() if last else self.group.model.no_sync()

    def _synced(
        self, agreed: Agreed, last: Forwarded, attempt: int, more: bool, quiet: bool
    ) -> tuple[bool, OomInfo | None]:
        """The last backward (DDP all-reduces its buckets), then the step. DDP averages the ranks'
        gradients; scaled by world_size * (this rank's items) / (all ranks' items), the average is
        the gradient of the mean loss over the global batch (its samples, or its `items`), uneven
        shards included."""
        d, runner, state, recovery = self.group, self.runner, self.state, self.recovery
        world = 1 if quiet else d.world_size  # a quiet step's buckets are summed, not averaged
        loss, n, count, loss_sum = last.loss, last.items, last.pieces, last.loss_sum
        if not agreed.items:  # the same on every rank: all raise here, before any collective
            recovery.drop_step()
            raise recovery.endings.no_items(everywhere=True)
        scale = world * state.units / agreed.items
        if not quiet and count > 1 and scale != 1:  # the no_sync micro-batches were weighted by this rank's share alone
            for group in runner.optimizer.param_groups:
                grads = [p.grad for p in group["params"] if p.grad is not None]
                if grads:
                    torch._foreach_mul_(grads, scale)
        d.begin_synced(news=quiet and self._news(more), mean=not quiet)
        failed, oom = last.oom, True
        weighted = None
        if loss is not None:
            weighted = loss * (world * n / agreed.items)
            try:
                runner.backward(weighted)
            except Exception as exc:
                stopped = d.bucket_error()
                if stopped is not None:  # this rank's wait for the others ended (a stop, a timeout)
                    recovery.drop_step()
                    raise stopped from None
                oom = is_oom(exc)
                if not oom and is_transport(exc):  # a rank stopped answering in DDP's all-reduce: at the timeout
                    abandon(None)
                    raise lost_ranks(exc, f" in the synced backward of step {state.steps + 1}") from None
                message = drop(exc) if oom else f"{type(exc).__name__}: {drop(exc)}"
                failed = OomInfo("backward", message, state.micro_batch_now(), state.baseline)
        fatal = False
        if failed is not None:
            halvable = state.sizing.can_halve(failed.micro_batch)
            fatal = not (oom and state.auto_recover and halvable and attempt <= MAX_RETRIES)
            if not d.failed_synced(fatal):  # after its gradients went out: the others step on them
                self.agreement.failure = failure = Failure(
                    f"{failed.message} after the synced backward on rank {d.rank}", oom=oom
                )
                recovery.drop_for(failure)
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
        failures, fatals, ranks, told = self._verdict(more, quiet, agreed.items)
        if told is not None and told.fatal:  # a rank's failure before its synced backward, said only now
            del weighted
            recovery.drop_for(self.agreement.failure)
            raise recovery.endings.job_error(self.agreement.failure, told)
        if failures:
            del weighted
            if not fatals:
                return False, failed
            if failed is None:
                raise recovery.dropped(recovery.endings.others_failed(ranks))
            raise recovery.dropped(recovery.endings.synced_failure(failed, fatal, oom, d.rank))
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
            message, was_oom = recovery.endings.optimizer_failed(exc, d.rank)
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
            stopped = self.group.bucket_error()
            if stopped is not None:  # this rank's wait for the others ended (a stop, a timeout)
                raise stopped from None
            raise self.recovery.endings.buckets_failed(message, self.group.rank, exc) from None
        finally:
            if tracker is not None:
                tracker.budget = budget
