"""The run's mutable state: what the parts of the trainer read and change between two steps.

Counters that the session keeps (steps, samples) are read from it, never copied here.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

from ..step.sizing import Sizing
from .deferred import DeferredLoss
from .session import RunSession


@dataclass(eq=False)
class RunState:
    session: RunSession
    sizing: Sizing
    micro_batch: int | None
    """The setting: a cap on the micro-batch; None is the whole global batch."""
    auto_recover: bool
    clip_grad_norm: float | None = None
    """The largest total gradient norm a step keeps (fit's option); None: not clipped."""
    batch_size: int = 0
    """The global batch now (this rank's share under torchrun), in samples."""
    units: int = 0
    """This rank's share of the global batch's items (samples without fit's `items`): the exchange's."""
    accumulation: int = 1
    epoch: int = 0
    epochs_done: int = 0
    ooms_recovered: int = 0
    loss: float | None = None
    """The newest loss read (on CUDA a step late: the result waits for the last)."""
    grad_norms: DeferredLoss = field(default_factory=DeferredLoss)
    """Each step's total gradient norm before clipping, read as the loss is: `grad_norms.last()` is the
    last step's, exactly (it waits for the copies on their way). fit gives the device's (CUDA: deferred)."""
    grad_norm: float | None = None
    """The newest gradient norm read (before clipping; inf or nan for a step the GradScaler skipped)."""
    skipped_steps: int = 0
    """fp16 steps the GradScaler skipped (an inf or nan gradient), counted as their norms are read."""
    stop_reason: str | None = None
    baseline: int = 0
    """Allocated between steps: where memory must return to after an OOM."""
    shapes: Hashable = None
    """The batch's shapes, as the last step saw them (the planner's key)."""

    @property
    def steps(self) -> int:
        return self.session.steps

    @property
    def samples(self) -> int:
        return self.session.samples

    def micro_batch_now(self) -> int:
        return min(self.micro_batch or self.batch_size, self.batch_size)

    def accumulation_at(self, micro_batch: int) -> int:
        """Micro-batches the global batch is cut into at `micro_batch`."""
        return self.sizing.accumulation(self.batch_size, micro_batch)
