"""One rank of several under DistributedDataParallel.

The rule that keeps a job from hanging: a rank handles an OOM alone only while it has issued no
collective of the step's gradients. The step's exchange (exchange.py) starts as the step does (what a
rank says is known then: its items, another batch, a stop, its last step's figures) and goes on
while its pieces but the last run under no_sync(), then the last one's forward; it is waited for
before the synced backward (an OOM there is rescued: this rank completes the buckets the others wait
for, and every rank replays; a rank that can no longer train completes them too, and every rank
stops), then the buffers' broadcast and optimizer.step().
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


class Forwarded(NamedTuple):
    """A rank's share up to its synced backward: the last micro-batch's loss (None: out of memory
    after DDP's synced forward returned, `oom`), its items, the micro-batch count, the loss so far."""

    loss: torch.Tensor | None
    items: int
    pieces: int
    loss_sum: torch.Tensor | None
    oom: OomInfo | None


class Ddp(Rank):
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
        early = d.can_rescue  # the exchange goes on while this rank runs its forwards
        self.generators.start()
        self.buffers.save()
        attempt = 0
        try:
            while True:
                attempt += 1
                last = None
                if early:
                    if batch is not None:
                        self._count_share(batch)
                    self.start_exchange(here=batch is not None, has_next=more)
                told = self.agreement.failure is not None  # in the exchange under way
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
                if not early:
                    self.start_exchange(here=batch is not None, has_next=more)
                agreed = self.finish_exchange()
                if agreed.fatal or not agreed.all_have_batch:
                    recovery.drop_step()
                    raise recovery.job_error(self.agreement.failure, agreed)
                if self.agreement.failure is not None and not told:  # after the exchange went out
                    raise self._failed_before_synced(agreed)
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

    def _failed_before_synced(self, agreed: Agreed) -> FitError:
        """This rank cannot train its share, and the exchange went out before it knew: the others are in
        the synced backward. It completes DDP's buckets with zeros, its verdict saying it cannot go on,
        so every rank drops the step and stops there."""
        d, recovery = self.group, self.recovery
        failure = self.agreement.failure
        assert failure is not None
        d.begin_synced()
        d.failed_synced(fatal=True)
        d.expect_backward()
        recovery.drop_step()
        self._complete_buckets(None, failure.message)
        d.agree_valid()  # the others read theirs: this one's says what they do
        return recovery.job_error(failure, agreed)

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
