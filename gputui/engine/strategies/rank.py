"""One rank of several: what DDP and FSDP2 share around a step (engine/strategies/ddp.py and fsdp.py
train it). The boundary (what the last exchange announced, applied alike on every rank; the pause's
heartbeats), the step's exchange (started, and waited for when its answer is needed), the batches
read one ahead, and the closing exchange.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from ...telemetry.hub import Hub
from ..boundary import Boundary
from ..oom import Buffers, Generators
from ..recovery import Recovery
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


class Rank:
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
        self._signalled: str | None = None  # the stop signal this rank said at the exchange under way
        self._waiter = waiter = Waiter(
            group.rank,
            group.world_size,
            timeout_s=group.rank_timeout,
            stop_asked=self._stop_asked,
            said=self._waiting,
            unanswered=lambda ranks, waited, stop: recovery.endings.unanswered(
                group.rank, ranks, waited, stop, group.rank_timeout
            ),
            ended=lambda other, steps, closing: recovery.endings.ended_apart(group.rank, other, steps, closing),
            steps=lambda: state.steps,
        )
        agreement.wait = waiter.wait
        if group.marker is not None:  # the synced backward's last bucket is waited for the same way
            group.marker.wait = lambda work: waiter.wait(work, -1 - state.steps, inside=True)

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
        self._waiter.closing = True
        try:
            agreed = self.agreement.exchange(items=None, has_next=False, stop=None, closing=True)
        finally:
            self._waiter.closing = False
        d = self.group
        if agreed.closing < d.world_size:  # it met another rank's step (one group for both: NCCL's side group)
            other = next((r for r in range(d.world_size) if r not in agreed.closing_ranks), 0)
            raise self.recovery.endings.ended_apart(d.rank, other, self.state.steps, closing=True)
        if agreed.fatal:
            raise self.recovery.endings.job_error(self.agreement.failure, agreed, closing=True)

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
            self.boundary.planning.paused(batch)  # a plan asked for is made now, as one process makes it
        if state.stop_reason is not None:  # agreed at the last exchange
            return False
        self._queue_asked()
        return True

    def _align(self) -> None:
        """Every rank to the smallest micro-batch setting any rank had at the last exchange; never up: the
        exchange went out as the step began, so a rank's own OOM in it is newer than what it said."""
        aligned = self.agreement.aligned()
        state = self.state
        if aligned is None or (state.micro_batch is not None and aligned[0] >= state.micro_batch):
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
        """An exchange started and waited for at once."""
        self.start_exchange(here=here, has_next=has_next)
        return self.finish_exchange()

    def start_exchange(self, *, here: bool, has_next: bool, **verdict: Any) -> None:
        """Start the exchange with what this rank says: its batch (`here`: its items in state.units), a
        signal, its micro-batch and batch, its last step's peak and capacity (after a synced backward,
        `verdict`: its own, the marked element's share, rank 0's proposed exchange interval)."""
        state, recovery = self.state, self.recovery
        self._signalled = signalled = self.boundary.signalled()
        memory, latest = self.session.memory, self.hub.latest()
        self.agreement.start(
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
            **verdict,
        )
        recovery.thrashing = False  # said

    def finish_exchange(self) -> Agreed:
        """Wait for the exchange started last. A stop agreed there is this rank's from now on."""
        d, state = self.group, self.state
        agreed = self.agreement.finish()
        if agreed.closing:  # another rank's closing exchange: its run ended where this one's went on
            other = agreed.closing_ranks[0] if agreed.closing_ranks else 0
            raise self.recovery.endings.ended_apart(d.rank, other, state.steps, closing=False)
        if agreed.stop is not None and state.stop_reason is None:
            state.stop_reason = self._signalled or agreed.stop
        for (
            r
        ) in self.agreement.ranks:  # another rank's OOM, recovered alone: said here too (each screen shows one rank)
            if r.rank != d.rank and r.ooms > self._ooms_seen.get(r.rank, 0):
                self.session.emit("rank_oom_recovered", rank=r.rank, ooms=r.ooms, micro_batch=r.micro_batch)
            self._ooms_seen[r.rank] = r.ooms
        return agreed

    def _count_share(self, batch: Any) -> None:
        """This rank's items for the exchange (its samples without `items`); a count that fails is this
        rank's failure, said there, not an exception the other ranks would wait on."""
        d, state = self.group, self.state
        try:
            state.units = self.runner.units(batch)
        except Exception as exc:
            message = str(exc) if isinstance(exc, FitError) else f"{type(exc).__name__}: {exc}"
            where = f"rank {d.rank}, step {state.steps + 1}, counting items"
            self.agreement.failure = Failure(f"{where}: {message}", oom=False, error=exc)

    def close(self) -> None:
        self.group.close()
