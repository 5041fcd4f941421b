"""The step's exchange under torchrun: one int64 vector, summed over the ranks, declared once here.

The vector is three tables end to end: the job's slots (each rank adds its share: counts, flags),
one count per (action, value) of the controls every rank applies together, and one row per rank
that only that rank writes (the others add zeros, so the sum is that rank's value exactly). Each
slot says how its value travels (`Kind`), so encoding and decoding are one loop each.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..telemetry.controls import ACTIONS

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
    "fatal_ranks": COUNT,  # the failing ranks below MASKED_RANKS, one bit each
    "interrupted": COUNT,  # ranks a SIGINT reached
    "terminated": COUNT,  # ranks a SIGTERM reached
    "requested": COUNT,  # ranks asked to stop (the stop control)
}
MASKED_RANKS = 62  # fatal_ranks names ranks below this one (bits of an int64)
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
    "peak": BYTES,  # its last step's peak
    "capacity": BYTES,
    "loss": FLOAT,  # its last step's loss (its share's)
    "samples_per_s": FLOAT,
    "ooms": COUNT,  # OOMs it recovered from, in all
    "thrashing": FLAG,  # its allocator thrashed since the last exchange
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
