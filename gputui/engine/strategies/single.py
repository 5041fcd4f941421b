"""One process: the step's OOMs are its own, so it replays a failed global batch at once."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from itertools import repeat
from typing import Any

import torch

from ...step.pieces import Progress
from ..boundary import Boundary
from ..oom import Buffers, Generators, OomInfo, cudnn_error, is_oom
from ..recovery import Recovery
from ..result import FitError
from ..runner import Runner
from ..state import RunState


class Single:
    looks_ahead = False  # a batch is read when its step comes
    ranks = ()

    def __init__(
        self,
        runner: Runner,
        recovery: Recovery,
        boundary: Boundary,
        state: RunState,
        generators: Generators,
        buffers: Buffers,
    ) -> None:
        self.runner, self.recovery, self.state = runner, recovery, state
        self.generators, self.buffers = generators, buffers
        self.at_boundary: Callable[[Any], bool] = boundary.passed  # bound once: the step calls it directly
        self._at = Progress()  # where the attempt under way is (one object, reset each attempt)

    def start(self) -> None:
        reason = self.recovery.no_budget_left()
        if reason:
            raise FitError(reason)
        self.runner.hold_accumulators()

    def batches(self, data: Iterable[Any], last: Callable[[], bool]) -> Iterator[tuple[Any, None]]:
        """Each batch as its step comes (no read ahead; one process asks no one whether there is more)."""
        return zip(data, repeat(None))

    def set_epoch(self, epoch: int) -> None:
        pass

    def end(self, epochs_done: int) -> None:
        pass

    def train(self, batch: Any, has_next: object) -> bool | None:
        """Train on one global batch, retrying it after OOMs; None: stopped before it was trained."""
        self.generators.start()
        if self.buffers.live:  # most models have no running statistics: no call a step
            self.buffers.save()
        retries = 0
        try:
            while True:
                size = self.state.micro_batch_now()
                self.runner.start(batch, size)
                oom = self._attempt(batch, size)
                if oom is None:
                    return True
                self.recovery.drop_step()
                retries += 1
                if not self.recovery.recover(oom, retries, batch):
                    return None
        finally:
            self.generators.end()

    def _attempt(self, batch: Any, size: int) -> OomInfo | None:
        """One try at a global batch in micro-batches of `size`; the OOM if it ran out of memory."""
        runner, at = self.runner, self._at
        at.phase = "forward"
        loss_sum: torch.Tensor | None
        pieces = [batch] if size >= self.state.batch_size else runner.cut(batch, size)
        try:
            if len(pieces) == 1:  # most steps: the batch whole, its loss as it is (read detached: the graph goes)
                if runner.items is not None and runner.none_counted(batch):
                    raise self.recovery.endings.no_items(everywhere=False)
                loss = runner.forward(batch)
                at.phase = "backward"
                runner.backward(loss)
                runner.piece_done()
                loss_sum = loss.detach()
                del loss
            else:
                counts, units = runner.counts(pieces, size)
                if not units:
                    raise self.recovery.endings.no_items(everywhere=False)
                loss_sum, _ = runner.run(pieces, counts, units, lambda n: n / units, at)
            at.phase = "optimizer"
            runner.optimizer_step()
        except Exception as exc:
            if is_oom(exc):
                return self.recovery.caught(exc, at.phase, size)
            # The script's own loop may catch it and train on: nothing of the failed step may leak into the
            # next (its pieces' gradients, running statistics, counted activations, draws), as after an OOM
            error = cudnn_error(exc)
            self.recovery.drop_failed_step(
                exc if error is None else error, runner.abandon_optimizer_step if at.phase == "optimizer" else None
            )
            if error is None:
                raise
            try:
                raise error from exc
            finally:  # the frame its traceback holds would hold it: the failed step's tensors kept to a collection
                del error
        assert loss_sum is not None  # the batch had at least one piece with items
        runner.done(loss_sum, len(pieces))
        return None

    def close(self) -> None:
        pass
