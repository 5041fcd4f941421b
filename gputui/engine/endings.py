"""The words a run ends with when a step cannot be trained on: every rank's FitError under torchrun
(the same on each, said at the exchange or in the synced backward), and one process's for a batch with
no items. Recovery owns it (`recovery.endings`): the strategies decide when, this says what."""

from __future__ import annotations

from typing import Any

from .diagnosis import fragmentation
from .oom import OomInfo, drop, is_oom
from .result import Agreed, Failure, FitError, add_note
from .session import RunSession
from .state import RunState


def holes(session: RunSession, oom: bool = True) -> str:
    """An unrecoverable OOM's error: the fragmentation that ran out, where it did (diagnosis.py), a
    sentence after the one it follows (ended here); nothing for another error."""
    split = fragmentation(session.probe.read()) if oom else None
    return f". {split}" if split else ""


class Endings:
    def __init__(self, session: RunSession, state: RunState) -> None:
        self.session, self.state = session, state

    def synced_failure(self, failed: OomInfo, fatal: bool, oom: bool, rank: int) -> FitError:
        """This rank's synced backward failed and cannot be replayed (`oom`: it ran out of memory): every
        rank stops."""
        if fatal:
            details: dict[str, Any] = {"phase": failed.phase, "message": failed.message}
            self.session.emit("oom", **details, micro_batch=failed.micro_batch, recovered=False)
        return FitError(
            f"{failed.message} in the synced {failed.phase} at micro-batch {failed.micro_batch} on rank "
            f"{rank}, step {self.state.steps + 1}: cannot recover here, so every rank stops{holes(self.session, oom)}"
        )

    def others_failed(self, ranks: list[int]) -> FitError:
        """`ranks`: those the verdict could name (below its dtype's bits), maybe none."""
        who = f"rank {', '.join(map(str, ranks))}" if ranks else "another rank"
        return FitError(
            f"{who} stopped at step {self.state.steps + 1} (said in the synced backward): "
            "every rank stops; that rank's output says why"
        )

    def buckets_failed(self, message: str, rank: int, exc: BaseException) -> FitError:
        return FitError(
            f"{message} in the synced backward on rank {rank}, step {self.state.steps + 1}, and completing its "
            f"gradient buckets failed too: the other ranks may be left waiting [{drop(exc)}]"
        )

    def optimizer_failed(self, exc: Exception, rank: int) -> tuple[str, bool]:
        """optimizer.step() failed on this rank after the others stepped: not safe to retry. The words
        for the next exchange, and whether it was an OOM."""
        oom = is_oom(exc)
        why = "out of memory" if oom else f"{type(exc).__name__}"
        message = (
            f"{why} inside optimizer.step() on rank {rank} at step {self.state.steps + 1}: not safe to retry, "
            f"so every rank stops [{drop(exc) if oom else exc}]"
        )
        if oom:
            self.session.emit("oom", phase="optimizer", message=message, recovered=False)
        return message, oom

    def fsdp_failure(self, exc: Exception, phase: str, size: int, rank: int) -> FitError:
        """A failure mid-step under FSDP: this rank cannot complete the collectives the others are in."""
        oom = is_oom(exc)
        what = f"out of memory in {phase}" if oom else f"{type(exc).__name__} in {phase}"
        detail = drop(exc) if oom else str(exc).splitlines()[0] if str(exc) else ""
        if oom:
            self.session.emit("oom", phase=phase, message=detail, micro_batch=size, recovered=False)
        return FitError(
            f"{what} at micro-batch {size} on rank {rank}, step {self.state.steps + 1}, under FSDP: a rank cannot "
            "finish its step's collectives alone, so every rank stops (fit halves every rank before a step "
            f"peak nears its capacity; this came first){holes(self.session, oom)} [{detail}]"
        )

    def job_error(self, failure: Failure | None, agreed: Agreed, closing: bool = False) -> FitError:
        """The error every rank raises together after a step some rank could not train (`closing`: at
        the exchange after the last step)."""
        if failure is not None:
            error = FitError(failure.message)
            error.__cause__ = failure.error
            for note in failure.notes:
                add_note(error, note)
            return error
        if agreed.fatal:
            ranks = ", ".join(map(str, agreed.fatal_ranks)) or "another rank"
            why = "out of memory" if agreed.fatal_oom == agreed.fatal else "an error"
            steps = self.state.steps
            when = f"after step {steps}" if closing else f"at step {steps + 1}"
            return FitError(f"rank {ranks} stopped {when} ({why}): every rank stops; that rank's output says why")
        return FitError(
            f"a rank's data yielded no batch in epoch {self.state.epoch + 1} while others had some: each rank needs "
            "at least one (a DistributedSampler gives every rank the same number)"
        )

    def unanswered(self, rank: int, ranks: list[int], waited: float, stop: str | None, timeout: float) -> FitError:
        """This rank gave up waiting for the others at the exchange: asked to stop, or at `rank_timeout`."""
        who = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
        at, waited_s = self.state.steps + 1, f"{waited:.0f} s"
        if stop is not None:
            return FitError(
                f"rank {rank} stopped ({stop}) while waiting for {who}, which stopped answering at step {at} "
                f"({waited_s})"
            )
        return FitError(
            f"{who} stopped answering: rank {rank} waited {waited_s} for it at step {at} (rank_timeout={timeout:g})"
        )

    def ended_apart(self, rank: int, other: int, steps: int, closing: bool) -> FitError:
        """The run ended on one rank and went on on another (the script's loops of unequal length): said on
        both, in seconds, instead of a collective mismatch or a wait until `rank_timeout`."""
        fix = "every rank's loop must take as many steps (a DistributedSampler gives each rank as many batches)"
        if closing:
            return FitError(
                f"rank {other} went on to step {steps + 1} after rank {rank}'s loop ended at step "
                f"{self.state.steps}: {fix}"
            )
        return FitError(
            f"rank {other}'s loop ended at step {steps} while rank {rank}'s went on to step "
            f"{self.state.steps + 1}: {fix}"
        )

    def no_items(self, everywhere: bool) -> FitError:
        where = "global batch" if everywhere else "batch"
        return FitError(
            f"items() counted 0 items in the whole {where} of step {self.state.steps + 1}"
            + (", on every rank" if everywhere else "")
            + ": no loss to train"
        )
