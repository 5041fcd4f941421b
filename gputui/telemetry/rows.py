"""A frozen record as a row of values, its layout read from the record's own declaration.

A step travels the attach protocol as a row (sample.StepRecord.row()): its fields' values in their
declared order, a record inside it (the memory, the host reading) as that record's row, a tuple of
records (the ranks) as a list of rows. The order, the types each value may arrive as and the client's
check of a row are all read here from the dataclasses' fields and annotations, so a field is declared
once, where its record is. The layout is the protocol's: a field added or moved is a new protocol.VERSION.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Sequence
from dataclasses import fields, is_dataclass
from operator import attrgetter, contains
from typing import Any

from .protocol import ProtocolError

_NONE = type(None)


def _accepted(hint: Any) -> tuple[frozenset[type], type | None, bool]:
    """What a field of this annotation is on the wire: (the exact types its value may be, the record
    whose row it is, whether a list of such rows).

    A count (a required int: step, batch, rank) arrives as an int, never a bool; any other number (a
    reading that may be unknown: bytes, a rate) as any JSON number, as the screen only formats those."""
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    args = typing.get_args(hint) if union else (hint,)
    optional = _NONE in args
    (kind,) = (arg for arg in args if arg is not _NONE)
    record, many = None, False
    accepted: set[type]
    if typing.get_origin(kind) is tuple:  # tuple[Record, ...]
        accepted, record, many = {list}, typing.get_args(kind)[0], True
    elif is_dataclass(kind):
        accepted, record = {list}, kind
    elif kind is int and not optional:
        accepted = {int}
    elif kind in (int, float):
        accepted = {int, float}
    else:
        accepted = {kind}
    return frozenset(accepted | ({_NONE} if optional else set())), record, many


class Layout:
    """The row of one kind of record: its fields' names, the types each value may be (a frozenset a
    value: a whole row is checked in one pass of C code, map/all, as a job sends hundreds a second),
    and which values are rows of records of their own (`nested`: index, their layout, whether a list)."""

    def __init__(self, cls: type, where: str, labels: dict[type, str], part: str = "") -> None:
        """`where`: how an error names the row ("a steps record's row"), `labels` a record inside it
        ("host reading"); `part`: this record's place in the row, for a record inside one."""
        hints = typing.get_type_hints(cls)
        self.cls, self.where, self.part = cls, where, part
        self.names = tuple(f.name for f in fields(cls))
        self.values = attrgetter(*self.names)
        """A record's values in this order, as a tuple."""
        accepted = [_accepted(hints[name]) for name in self.names]
        self.types = tuple(kinds for kinds, _, _ in accepted)
        self.nested = tuple(
            (i, Layout(record, where, labels, f"{part}'s {labels[record]}"), many)
            for i, (_, record, many) in enumerate(accepted)
            if record is not None
        )
        if any(inner.nested for _, inner, _ in self.nested):  # the check bounds a row's depth, not a walk
            raise TypeError(f"{cls.__name__}: a record in a record in a row; rows stay three levels deep")

    def index(self, name: str) -> int:
        return self.names.index(name)

    def row(self, values: Sequence[Any]) -> list[Any]:
        """A record's values (`values(record)`, or a published row) as the protocol sends them."""
        row = list(values)
        for i, inner, many in self.nested:
            value, of = row[i], inner.values
            if value is not None:
                row[i] = [of(item) for item in value] if many else of(value)
        return row

    def fields(self, row: list[Any]) -> tuple[Any, ...]:
        """A row back into the record's values (its shape and types checked already: check())."""
        values = list(row)
        for i, inner, many in self.nested:
            value, cls = values[i], inner.cls
            if value is not None:
                values[i] = tuple([cls(*item) for item in value]) if many else cls(*value)
        return tuple(values)

    def check(self, row: Any, index: int) -> None:
        """ProtocolError unless `row` is this record's row, the rows inside it too (`index`: the row's,
        as the error names it, with the field that is wrong)."""
        t = self.types
        if not (type(row) is list and len(row) == len(t) and all(map(contains, t, map(type, row)))):
            where = f"{self.where} {index}{self.part}"
            if type(row) is not list or len(row) != len(t):
                raise ProtocolError(f"{where} is not a list of {len(t)} values")
            name, value = next((n, v) for n, v, ok in zip(self.names, row, t, strict=True) if type(v) not in ok)
            raise ProtocolError(f"{where}: {name!r} is {article(type(value).__name__)}")
        for i, inner, many in self.nested:
            value = row[i]
            if many:
                for item in value:
                    inner.check(item, index)
            elif value is not None:
                inner.check(value, index)


def article(noun: str) -> str:
    """The noun after its article: "a str", "an int"."""
    return f"{'an' if noun[:1] in 'aeiou' else 'a'} {noun}"
