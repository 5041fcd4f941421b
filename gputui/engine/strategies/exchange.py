"""The step's exchange under torchrun: one int64 vector, summed over the ranks, declared once here.

The vector is three tables end to end: the job's slots (each rank adds its share: counts, flags),
one count per (action, value) of the controls every rank applies together, and one row per rank
that only that rank writes (the others add zeros, so the sum is that rank's value exactly). Each
slot says how its value travels (`Kind`), so encoding and decoding are one loop each.
"""

from __future__ import annotations

import itertools
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ...telemetry.controls import ACTIONS, Control
from ...telemetry.sample import RankMemory
from ..result import Agreed, Failure
from .group import collective
from .verdict import rank_bit, ranks_in

_exchanges = itertools.count()  # this process's exchanges: the same count on every rank, every fit alike


def _wait(work: Any, seq: int) -> None:
    collective(work.wait)


_NONE = 0x7FF80000DEADBEEF  # a float not known: a NaN no arithmetic makes (torch's NaN has no payload)


def _float_bits(value: float | None) -> int:
    """Its float64 bits: the others write 0 in its slot, so the sum is the bits, whatever the value."""
    return _NONE if value is None else struct.unpack("<q", struct.pack("<d", value))[0]


def _bits_float(slot: int) -> float | None:
    return None if slot == _NONE else struct.unpack("<d", struct.pack("<q", slot))[0]


@dataclass(frozen=True)
class Kind:
    """How a value travels in an int64 slot."""

    encode: Callable[[Any], int]
    decode: Callable[[int], Any]


COUNT = Kind(lambda value: int(value or 0), lambda slot: slot)
FLAG = Kind(lambda value: int(bool(value)), bool)
BYTES = Kind(lambda value: -1 if value is None else int(value), lambda slot: None if slot < 0 else slot)  # 0 is a count
FLOAT = Kind(_float_bits, _bits_float)

JOB: dict[str, Kind] = {
    "has_batch": COUNT,  # ranks with a batch this step
    "items": COUNT,  # the global batch's items (samples, or what fit(items=) counts)
    "has_next": COUNT,  # ranks with another batch after this one
    "fatal": COUNT,  # ranks that cannot go on
    "fatal_oom": COUNT,  # of those, out of memory
    "fatal_ranks": COUNT,  # the failing ranks (rank_bit: below MASKED_RANKS, one bit each)
    "interrupted": COUNT,  # ranks a SIGINT reached
    "terminated": COUNT,  # ranks a SIGTERM reached
    "requested": COUNT,  # ranks asked to stop (the stop control)
    "failed": COUNT,  # ranks whose synced backward failed (an exchange after it)
    "failed_fatal": COUNT,  # of those, ranks that cannot go on
    "failed_ranks": COUNT,  # those ranks below MASKED_RANKS, one bit each
    "every": COUNT,  # rank 0's steps between two exchanges when no rank has news
    "closing": COUNT,  # ranks whose run is closing: this is their last exchange
    "closing_ranks": COUNT,  # those ranks below MASKED_RANKS, one bit each
}
STOPS = ("terminated", "interrupted", "requested")
"""The stop slots, each named for the reason it gives; the first set wins."""

CONTROLS: tuple[tuple[str, Any], ...] = tuple(
    (action, value)
    for action, values in ACTIONS.items()
    if action != "stop"  # a slot of its own: `requested`
    for value in (values if values is not None else (None,))
)
"""The controls every rank applies together, in this order (the same on every rank, so the same
state on every rank after them)."""

RANK: dict[str, Kind] = {
    "micro_batch": COUNT,  # what the rank runs
    "setting": COUNT,  # its micro-batch setting (0: the whole batch)
    "batch": COUNT,  # its share of the global batch, in samples
    "peak": BYTES,  # its last step's peak (every step is read under torchrun: engine/core.py)
    "capacity": BYTES,
    "loss": FLOAT,  # its last step's loss (its share's)
    "samples_per_s": FLOAT,
    "ooms": COUNT,  # OOMs it recovered from, in all
    "thrashing": FLAG,  # its allocator thrashed since the last exchange
    "marker": FLOAT,  # its share of the gradient element the marker took (verdict.py)
}


@dataclass(frozen=True)
class Summed:
    """What an exchange's sum says: the job's slots, the controls' counts, each rank's row."""

    job: dict[str, int]
    controls: list[int]
    ranks: list[dict[str, Any]]


def encode(
    job: Mapping[str, Any], controls: Sequence[int], mine: Mapping[str, Any], rank: int, world: int
) -> list[int]:
    """This rank's vector: its share of the job's slots, its control counts, its own row at `rank`."""
    vector = [JOB[name].encode(job.get(name)) for name in JOB]
    vector += list(controls)
    for r in range(world):
        vector += [kind.encode(mine.get(name)) for name, kind in RANK.items()] if r == rank else [0] * len(RANK)
    return vector


def decode(total: Sequence[int], world: int) -> Summed:
    job = dict(zip(JOB, total[: len(JOB)], strict=True))
    first_rank = len(JOB) + len(CONTROLS)
    rows = [total[first_rank + len(RANK) * r : first_rank + len(RANK) * (r + 1)] for r in range(world)]
    return Summed(
        job=job,
        controls=list(total[len(JOB) : first_rank]),
        ranks=[{name: kind.decode(v) for (name, kind), v in zip(RANK.items(), row, strict=True)} for row in rows],
    )


class Agreement:
    """The step's one exchange, as this rank keeps it: what it will say (its failure, the controls
    asked of it) and what the last exchange told every rank (the ranks' rows, the controls every rank
    applies, the job's micro-batch and batches)."""

    def __init__(self, rank: int, world_size: int, group: Any = None, closing_group: Any = None) -> None:
        self.rank, self.world_size = rank, world_size
        self.group = group  # the exchange's: the default group, or a gloo one beside nccl (a CPU vector)
        self.closing_group = closing_group  # the closing exchange's (group.side_group)
        self.wait: Callable[[Any, int], None] = _wait  # how a rank waits for it: the strategy's Waiter
        self.failure: Failure | None = None
        self._outgoing: list[Control] = []
        self._agreed: list[Control] = []
        self.ranks: tuple[RankMemory, ...] = ()
        """Every rank's micro-batch, step peak and capacity, as the last exchange told them."""
        self._configured: list[int] = []  # every rank's micro_batch setting at the last exchange (0: whole)
        self._batches: list[int] = []  # every rank's batch at the last exchange
        self._resized: int | None = None  # the job's micro-batch as set at this boundary
        self.thrashing: list[int] = []  # the ranks whose allocator thrashed, as the last exchange said
        self._pending: tuple[torch.Tensor, dict[tuple[str, Any], list[Control]], Any, int] | None = None

    def queue(self, controls: list[Control]) -> None:
        """Controls this rank drained at its boundary: the next exchange tells every rank."""
        self._outgoing.extend(controls)

    @property
    def has_news(self) -> bool:
        """Whether this rank has something to tell the others: controls asked of it, or its failure."""
        return bool(self._outgoing) or self.failure is not None

    def aligned(self) -> tuple[int, int] | None:
        """The smallest micro-batch setting among the ranks (and a rank that has it), where some rank
        set one (an OOM it recovered from alone, a control): every rank runs the same from the next
        boundary, so a step's micro-batches line up and a control acts on the same value everywhere."""
        set_ = [(size, r) for r, size in enumerate(self._configured) if size > 0]
        return min(set_) if set_ else None

    def passes(self, setting: int | None) -> int:
        """Forward/backward passes every rank runs in this step under FSDP (each all-gathers, so the
        count must be the same everywhere): the most any rank's batch needs at `setting` (the micro-batch
        setting, aligned on every rank; None: the whole batch), as the exchange just told."""
        return max((-(-b // min(setting or b, b)) for b in self._batches if b > 0), default=1)

    def job_sizes(self) -> tuple[int, int]:
        """The job's micro-batch and batch at the last exchange: the largest rank's (or what a resize at
        this boundary made it). Halve and double act on these, so every rank decides alike (a rank
        with a short last batch would not), and two halvings at one boundary halve twice."""
        micro = self._resized if self._resized is not None else max(r.micro_batch for r in self.ranks)
        return micro, max(self._batches)

    def resized(self, micro_batch: int) -> None:
        """Every rank set the job's micro-batch at this boundary (the next exchange says it anyway)."""
        self._resized = micro_batch

    def take_agreed(self) -> list[Control]:
        """The controls the last exchange announced, for every rank to apply at this boundary."""
        agreed, self._agreed = self._agreed, []
        return agreed

    def exchange(self, **said: Any) -> Agreed:
        """The exchange started and waited for at once (start() says what a rank says)."""
        self.start(**said)
        return self.finish()

    @property
    def pending(self) -> bool:
        """An exchange started and not yet waited for."""
        return self._pending is not None

    def start(
        self,
        *,
        items: int | None,
        has_next: bool,
        stop: str | None,
        micro_batch: int | None = None,
        setting: int | None = None,
        batch: int | None = None,
        peak: int | None = None,
        capacity: int | None = None,
        loss: float | None = None,
        samples_per_s: float | None = None,
        ooms: int = 0,
        thrashing: bool = False,
        failed: bool = False,
        failed_fatal: bool = False,
        marker: float | None = None,
        every: int = 0,
        closing: bool = False,
    ) -> None:
        """Start the step's one collective (asynchronous, on the CPU), waited for by finish(): before the
        synced backward, after it on a quiet step (ddp.py), before any forward under FSDP; `items`: this
        rank's share of the
        global batch's items (samples, unless fit counts items), None: no batch here. Each rank also
        says its micro-batch (what it runs, and its setting: None for the whole batch) and its last
        step's peak and capacity, in a row of its own (declared above). `closing`: the run's last exchange,
        on the closing group (group.side_group), said in its slots."""
        asked: dict[tuple[str, Any], list[Control]] = {}
        for control in self._outgoing:
            asked.setdefault((control.action, control.value), []).append(control)
        self._outgoing = []
        failure = self.failure
        job = {
            "has_batch": items is not None,
            "items": items,
            "has_next": has_next,
            "fatal": failure is not None,
            "fatal_oom": failure is not None and failure.oom,
            "fatal_ranks": rank_bit(self.rank, failure is not None),
            **{reason: stop == reason for reason in STOPS},
            "failed": failed,
            "failed_fatal": failed and failed_fatal,
            "failed_ranks": rank_bit(self.rank, failed),
            "every": every,
            "closing": closing,
            "closing_ranks": rank_bit(self.rank, closing),
        }
        job["requested"] = job["requested"] or bool(asked.pop(("stop", None), None))
        mine = {
            "micro_batch": micro_batch,
            "setting": setting,
            "batch": batch,
            "peak": peak,
            "capacity": capacity,
            "loss": loss,
            "samples_per_s": samples_per_s,
            "ooms": ooms,
            "thrashing": thrashing,
            "marker": marker,
        }
        counts = [len(asked.get(key, ())) for key in CONTROLS]
        tensor = torch.tensor(encode(job, counts, mine, self.rank, self.world_size), dtype=torch.int64)
        work = dist.all_reduce(tensor, group=self.closing_group if closing else self.group, async_op=True)
        self._pending = (tensor, asked, work, next(_exchanges))

    def finish(self) -> Agreed:
        """Wait for the exchange started last (a CPU collective: it went on while this rank worked),
        and keep what it says."""
        assert self._pending is not None
        tensor, asked, work, seq = self._pending
        self._pending = None
        self.wait(work, seq)
        summed = decode(tensor.tolist(), self.world_size)
        for (action, value), count in zip(CONTROLS, summed.controls, strict=True):
            local = asked.get((action, value), [])
            others = count - len(local)
            self._agreed.extend(local + [Control(action, value, source="another rank") for _ in range(others)])
        rows = summed.ranks
        self.ranks = tuple(
            RankMemory(
                r,
                row["micro_batch"],
                row["peak"],
                row["capacity"],
                loss=row["loss"],
                samples_per_s=row["samples_per_s"],
                ooms=row["ooms"],
            )
            for r, row in enumerate(rows)
        )
        self.thrashing = [r for r, row in enumerate(rows) if row["thrashing"]]
        self._resized = None
        self._configured = [row["setting"] for row in rows]
        self._batches = [row["batch"] for row in rows]
        totals = summed.job
        markers = [row["marker"] for row in rows]
        return Agreed(
            items=totals["items"],
            all_have_batch=totals["has_batch"] == self.world_size,
            all_have_next=totals["has_next"] == self.world_size,
            fatal=totals["fatal"],
            fatal_oom=totals["fatal_oom"],
            fatal_ranks=ranks_in(totals["fatal_ranks"], self.world_size),
            stop=next((reason for reason in STOPS if totals[reason]), None),
            failed=totals["failed"],
            failed_fatal=totals["failed_fatal"],
            failed_ranks=ranks_in(totals["failed_ranks"], self.world_size),
            marker=None if None in markers else sum(markers),
            every=totals["every"],
            closing=totals["closing"],
            closing_ranks=ranks_in(totals["closing_ranks"], self.world_size),
        )
