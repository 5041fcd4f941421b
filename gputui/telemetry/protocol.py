"""The attach protocol: newline-delimited JSON objects, each with "v" (the version) and "kind".

Server to client: hello (who the job is), history (the run so far, in bounded points), then
start / steps / event / end / gpus / output records as they happen (steps: the steps since the
server's last turn, each a row of values in StepSample's field order, sample.StepRecord.row()),
ack / error answers to a client's requests, and live (the history is over). Client to server:
hello (optionally asking for control) and control requests. Client lines are small, bounded and checked field by field:
nothing a client sends is ever evaluated or unpickled. Server lines are stripped of control
characters (a fake or broken job must not drive the user's terminal) and bounded in depth.
"""

from __future__ import annotations

import json
import math
from typing import Any

from .controls import ACTIONS
from .printable import printable

VERSION = 3
"""The protocol's version, in every line; bumped on any incompatible change (2: steps as rows, whose
layout is StepSample's fields: a field added is a new version; 3: a step's grad_norm). A client and a
job that differ say so rather than misread each other."""

MAX_CLIENT_LINE = 4096
"""Bytes a client line may take: a control request needs under 200."""

MAX_SERVER_LINE = 8 * 2**20
"""Bytes a server line may take (the history line is the largest)."""

MAX_DEPTH = 32
"""Nesting a server record may have: the deepest real one (gpus: devices, processes) has 5."""

MAX_INT = 2**63
"""Largest integer a server record may hold: counters and bytes fit in 64 bits, and a float()
or a format of a 400-digit integer raises where the screen shows it."""

CLIENT_KINDS = ("hello", "control")


class ProtocolError(ValueError):
    """A line that is not a valid message; the text says what is wrong, for the peer."""


class VersionMismatch(ProtocolError):
    """A gputui of another protocol version at the other end (one upgraded while a job ran): trying
    again will not help."""


def encode(record: dict[str, Any]) -> bytes:
    """One line; ValueError for a NaN or an infinity (clean() makes them null), TypeError for what JSON
    has no form for. The records' own "v" (their metrics-file version) gives way to the protocol's."""
    return json.dumps({**record, "v": VERSION}, separators=(",", ":"), allow_nan=False).encode() + b"\n"


def _object(line: bytes, limit: int) -> dict[str, Any]:
    if len(line) > limit:
        raise ProtocolError(f"message of {len(line)} bytes exceeds the {limit}-byte limit")
    try:
        # Decoded as UTF-8 here: json.loads(bytes) would guess UTF-16/32 too, and a UTF-16 line of ASCII
        # bytes would carry what the escape walk strips past the plain-line check.
        data = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ProtocolError(f"not JSON: {exc}") from None
    except RecursionError:  # e.g. 2000 "[": the parser recurses per level
        raise ProtocolError("not JSON: nested too deeply") from None
    if not isinstance(data, dict):
        raise ProtocolError("a message must be a JSON object")
    theirs = data.get("v")
    if theirs != VERSION:
        if isinstance(theirs, int) and not isinstance(theirs, bool):
            raise VersionMismatch(
                f"unsupported protocol version {theirs} (this side speaks {VERSION}): "
                "use the gputui that started the job, or the same version"
            )
        raise ProtocolError(f"unsupported protocol version {repr(theirs)[:40]} (this side speaks {VERSION})")
    if not isinstance(data.get("kind"), str):
        raise ProtocolError("a message needs a string 'kind'")
    return data


def parse_client(line: bytes) -> dict[str, Any]:
    """A client's line, validated: {"kind": "hello", "control": bool} or
    {"kind": "control", "id": int, "action": str, "value": ...}. ProtocolError otherwise."""
    data = _object(line, MAX_CLIENT_LINE)
    kind = data["kind"]
    if kind == "hello":
        control = data.get("control", False)
        if not isinstance(control, bool):
            raise ProtocolError("hello: 'control' must be true or false")
        return {"kind": "hello", "control": control}
    if kind == "control":
        ident = data.get("id")
        if not isinstance(ident, int) or isinstance(ident, bool) or not 0 <= ident < 2**53:
            raise ProtocolError("control: 'id' must be a non-negative integer")
        action = data.get("action")
        if not isinstance(action, str) or action not in ACTIONS:  # a list or an object: unhashable
            raise ProtocolError(f"control: unknown action {action!r}")
        value = data.get("value")
        if value is not None and not isinstance(value, (str, bool)):
            raise ProtocolError("control: 'value' must be a string, a boolean or absent")
        return {"kind": "control", "id": ident, "action": action, "value": value}
    raise ProtocolError(f"unknown kind {kind!r} (expected one of {', '.join(CLIENT_KINDS)})")


_DIGITS = bytes.maketrans(b"0123456789E", b"0000000000e")
_RISKY = (b"0" * 19, b"e000", b"e+000", b"e-000", b"NaN", b"Infinity")
"""In a line's bytes with every digit made 0 (a translate and a few finds: a regex costs several times
more), what may be a number the walk must look at: an integer past 18 digits, an exponent of three
digits (1e999 parses as infinity), NaN or an infinity."""


def parse_server(line: bytes) -> dict[str, Any]:
    """A server's line as a dict with a known version and a kind, every string in it (keys too)
    stripped of escape sequences and control characters, and of newlines but in a `text` (a
    report: a fake argv must not print a row of its own in `gputui jobs`), every number one that
    Python can format (no NaN, no 400-digit integer); ProtocolError otherwise.

    A line of printable ASCII without a backslash (JSON escapes every control character, and takes
    none raw in a string) has nothing to strip; with no risky number and fewer brackets than the
    depth limit, it is returned as parsed: the steps, many a second, cost no walk. A steps record
    has a bracket or four a step, and is exempt from that count when it holds its rows and nothing
    else: their shape is checked whole (checks.checked(): rows of values, three levels at most),
    and nothing reads them before."""
    data = _object(line, MAX_SERVER_LINE)
    rows_only = data["kind"] == "steps" and data.keys() <= _STEPS_KEYS
    return data if _plain(line, not rows_only) else _printable(data, 0, None)


_STEPS_KEYS = {"v", "kind", "rows"}


def _plain(line: bytes, count_brackets: bool) -> bool:
    if (
        not line.isascii()
        or b"\\" in line
        or b"\x7f" in line
        or b"\x00" in line
        or count_brackets
        and line.count(b"{") + line.count(b"[") > MAX_DEPTH
    ):
        return False
    digits = line.translate(_DIGITS)
    for risky in _RISKY:
        if risky in digits:
            return False
    return True


def _printable(value: Any, depth: int, key: str | None) -> Any:
    if isinstance(value, str):
        text = printable(value)
        return text if key == "text" else text.replace("\n", " ")
    if isinstance(value, float) and not math.isfinite(value):
        raise ProtocolError(f"{key!r} is not a finite number")
    if isinstance(value, int) and not -MAX_INT <= value <= MAX_INT:
        raise ProtocolError(f"{key!r} is an integer past 64 bits")
    if isinstance(value, dict):
        if depth >= MAX_DEPTH:
            raise ProtocolError(f"a record nested deeper than {MAX_DEPTH} levels")
        return {printable(k).replace("\n", " "): _printable(v, depth + 1, k) for k, v in value.items()}
    if isinstance(value, list):
        if depth >= MAX_DEPTH:
            raise ProtocolError(f"a record nested deeper than {MAX_DEPTH} levels")
        return [_printable(v, depth + 1, key) for v in value]
    return value


def clean(value: Any) -> Any:
    """JSON-safe: NaN and infinities become None, tuples lists, unknown objects their str()."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)
