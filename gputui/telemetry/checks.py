"""What a client accepts of a job's records: the fields the clients read, each of the type they read it as.

The TUI, `gputui jobs` and `attach --json` format these fields; a wrong type would raise there, far
from the socket. So every record a Connection reads is checked here first, and a broken or fake job
is one ProtocolError naming the field, never a traceback.
"""

from __future__ import annotations

from typing import Any

from .describe import describe
from .protocol import ProtocolError
from .rows import article
from .run import NUMBER, RunInfo, RunSummary
from .sample import STEP_ROW, Event

# What the clients read, by record kind: field -> accepted types (None is always accepted, and
# a field not named here passes as it is). A steps record's rows are checked by their layout.
_DEVICE = {
    "index": int,
    "uuid": str,
    "name": str,
    "utilization": NUMBER,
    "memory_used": NUMBER,
    "memory_total": NUMBER,
    "temperature": NUMBER,
    "power": NUMBER,
    "power_limit": NUMBER,
    "processes": list,
    "error": str,
}
_PROCESS = {"pid": int, "gpu_memory": NUMBER, "kind": str, "user": str, "command": str}
_KINDS: dict[str, dict[str, Any]] = {
    "hello": {
        "pid": int,
        "argv": list,
        "server_started": NUMBER,
        "runs": int,
        "info": dict,
        "summary": dict,
        "controllable": bool,
    },
    "start": {"runs": int, "info": dict},
    "end": {"summary": dict},
    "event": {"name": str, "step": int, "t": NUMBER},
    "history": {"series": dict},
    "gpus": {"t": NUMBER, "driver": str, "status": str, "devices": list},
    "output": {"lines": list, "current": str, "total": int, "dropped": int},
    "ack": {"id": int, "request_id": int, "hello": bool, "control": bool},
    "error": {"id": int, "reason": str},
}


def _rows(rows: Any) -> None:
    if type(rows) is not list:
        raise ProtocolError("a steps record without its rows")
    for index, row in enumerate(rows):
        STEP_ROW.check(row, index)


def _fields(record: Any, types: dict[str, Any], where: str) -> None:
    if not isinstance(record, dict):
        raise ProtocolError(f"{where} is {article(type(record).__name__)}, not an object")
    for name, accepted in types.items():
        value = record.get(name)
        if value is not None and (not isinstance(value, accepted) or isinstance(value, bool) and accepted is not bool):
            raise ProtocolError(f"{where}: {name!r} is {article(type(value).__name__)}")


def checked(record: dict[str, Any]) -> dict[str, Any]:
    """`record` if the fields the clients read have their types; ProtocolError saying which does not."""
    kind = record["kind"]
    where = f"{article(kind)} record"
    _fields(record, _KINDS.get(kind, {}), where)
    if kind == "steps":
        _rows(record.get("rows"))
        return record
    for name, cls in (("info", RunInfo), ("summary", RunSummary)):
        if record.get(name) is not None:
            try:
                cls.from_json(record[name])
            except (ValueError, TypeError, AttributeError) as exc:
                raise ProtocolError(f"{where}'s {name}: {exc}") from None
    if not all(isinstance(arg, str) for arg in record.get("argv") or ()):
        raise ProtocolError(f"{where}'s argv holds a non-string")
    if kind == "event":
        try:
            describe(Event.from_json(record))  # what the timeline, the progress line and ctl print
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
            raise ProtocolError(f"an event the client cannot describe: {type(exc).__name__}") from None
    elif kind == "history":
        for name, series in (record.get("series") or {}).items():
            _fields(series, {"steps": list, "values": list, "stride": int}, f"the history of {name}")
            if not all(isinstance(x, int) for x in series.get("steps") or ()) or not all(
                x is None or isinstance(x, NUMBER) for x in series.get("values") or ()
            ):
                raise ProtocolError(f"the history of {name} holds a non-number")
    elif kind == "output":
        if not all(isinstance(line, str) for line in record.get("lines") or ()):
            raise ProtocolError("an output record's lines hold a non-string")
    elif kind == "gpus":
        for device in record.get("devices") or ():
            _fields(device, _DEVICE, "a GPU")
            for process in device.get("processes") or ():
                _fields(process, _PROCESS, "a GPU process")
    return record
