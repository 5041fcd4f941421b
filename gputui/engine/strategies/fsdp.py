"""One rank of several under FSDP2, where every forward all-gathers and every synced backward
reduce-scatters: no rank can replay alone, so the exchange comes first in the step (the global
batch's items are known before any forward) and any failure ends the run; OOMs are prevented
instead (Rank._prevent: every rank halves before a step peak nears its capacity)."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

from ...step.pieces import Progress
from ..oom import is_oom
from ..result import FitError
from .ddp import Ddp, HasNext
from .group import abort, is_transport, lost_ranks


class Fsdp(Ddp):
    def train(self, batch: Any, has_next: HasNext) -> bool | None:
        d, runner, state, recovery = self.group, self.runner, self.state, self.recovery
        more = has_next()
        if batch is not None:
            self._count_share(batch)
        agreed = self.exchange(here=batch is not None, has_next=more)
        if agreed.fatal or not agreed.all_have_batch:
            raise recovery.endings.job_error(self.agreement.failure, agreed)
        if not agreed.items:
            raise recovery.endings.no_items(everywhere=True)
        total, world = state.batch_size, d.world_size
        # Every rank runs as many passes as the one that needs the most (each all-gathers): a rank
        # with fewer samples splits its share finer, and one with fewer samples than passes runs the
        # rest at weight 0 (on its smallest piece with items: step/pieces.py).
        count = self.agreement.passes(state.micro_batch)
        size = -(-total // count)
        runner.start(batch, size)
        pieces = runner.cut(batch, size)
        real = len(pieces)
        at = Progress()
        units = state.units
        try:
            counts = runner.counts(pieces, size)[0] if real > 1 else [units]
            counts += [0] * (count - real)
            pieces += [pieces[-1]] * (count - real)
            # FSDP averages over the ranks, as DDP does; each pass is a collective: an empty piece runs at weight 0
            loss_sum, _ = runner.run(
                pieces, counts, units, lambda n: world * n / agreed.items, at, sync=self._sync, skip_empty=False
            )
            at.phase = "optimizer"
            d.broadcast_buffers()
            runner.optimizer_step()
        except Exception as exc:
            raise self._failure(exc, at.phase, size) from None
        finally:
            d.gradient_sync(True)
        assert loss_sum is not None
        runner.done(loss_sum, count)
        return agreed.all_have_next

    def _sync(self, last: bool) -> AbstractContextManager[Any]:
        self.group.gradient_sync(last)  # FSDP2's no_sync: off, a backward accumulates without reduce-scattering
        return nullcontext()

    def _failure(self, exc: Exception, phase: str, size: int) -> FitError:
        """This rank cannot complete the collectives the others are in: it leaves the group (a group
        fit made), so theirs fail at once, and every rank ends with a FitError."""
        d = self.group
        if isinstance(exc, FitError):  # said already (a lost rank in fit's own collective)
            return exc
        if is_oom(exc) or not is_transport(exc):
            error = self.recovery.endings.fsdp_failure(exc, phase, size, d.rank)
        else:  # another rank left: this one did nothing wrong
            error = lost_ranks(exc)  # before abort(): it names this rank from the group
        abort()
        return error
