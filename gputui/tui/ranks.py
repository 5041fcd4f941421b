"""Which ranks of a torchrun job the ranks panel has lines for: all of them when they fit, else the
ones closest to their OOM and the rank this screen is attached to."""

from __future__ import annotations

from dataclasses import dataclass

from ..telemetry.sample import RankMemory


def share(rank: RankMemory) -> float | None:
    """The rank's step peak over its capacity; None where either is unknown."""
    return rank.peak / rank.capacity if rank.peak is not None and rank.capacity else None


def severity(rank: RankMemory) -> tuple[float, int]:
    """How close a rank is to its OOM: peak over capacity, or the peak alone where capacities are unknown."""
    known = share(rank)
    return (-1.0 if known is None else known), rank.peak or 0


@dataclass(frozen=True)
class Ranks:
    """What the ranks panel shows of a torchrun job: the ranks it has lines for, in rank order, and the
    ones it leaves out (many ranks: the worst few and this one are shown). Hashable: the panel's key."""

    shown: tuple[RankMemory, ...]
    worst: int | None  # the rank closest to its OOM; None before any peak is known
    this: int | None  # the rank this screen is attached to
    hidden: int = 0
    hidden_worst: RankMemory | None = None  # the worst of those left out: how close the rest come

    @classmethod
    def pick(cls, ranks: tuple[RankMemory, ...], this: int | None, lines: int) -> Ranks:
        """The ranks in at most `lines` lines (at least 3): all of them when they fit, else the worst ones
        and this rank, with a line left to say how many are not shown."""
        order = sorted(ranks, key=severity, reverse=True)
        worst = order[0].rank if order[0].peak is not None else None
        if len(ranks) <= lines:
            return cls(tuple(ranks), worst, this)
        keep = order[: max(2, lines - 1)]
        if this is not None and all(r.rank != this for r in keep):
            keep[-1:] = [r for r in ranks if r.rank == this]
        kept = {r.rank for r in keep}
        left = [r for r in order if r.rank not in kept]
        shown = tuple(sorted(keep, key=lambda r: r.rank))
        return cls(shown, worst, this, len(left), left[0] if left else None)
