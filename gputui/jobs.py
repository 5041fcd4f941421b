"""`gputui jobs`, `gputui attach --json` and `gputui ctl`: talking to running jobs without the TUI.

No torch here: these start in a fraction of a second on a login node or in a tmux pane. Whatever
the job at the other end does (closes early, stays silent, sends garbage), the user gets one
line and exit code 1: every failure of the conversation becomes a JobError.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, TextIO

from .telemetry.client import Connection, Welcome, wait_for_answer
from .telemetry.controls import ACTIONS
from .telemetry.describe import describe, plan_lines, waiting_text
from .telemetry.paths import (
    ForeignPeer,
    Job,
    UnsafeDirectory,
    check_socket,
    existing_dir,
    find_jobs,
    pid_alive,
    socket_dir,
    socket_path,
)
from .telemetry.protocol import ProtocolError, VersionMismatch
from .telemetry.run import RunSummary
from .telemetry.sample import Event
from .units import format_duration

ACK_WAIT = 5.0
"""Seconds a job may take to acknowledge a control request."""


class JobError(Exception):
    """A job cannot be found or reached; the message is the one line the user sees."""


def _failed(job: Job, exc: Exception) -> JobError:
    """What went wrong talking to `job`, as one line."""
    reason = " ".join(str(exc).split()) or type(exc).__name__
    if isinstance(exc, ProtocolError) and not isinstance(exc, VersionMismatch):
        reason = f"not a gputui job? {reason}"
    return JobError(f"job {job.pid} ({job.path}): {reason}")


def _jobs() -> list[Job]:
    try:
        return find_jobs()
    except UnsafeDirectory as exc:
        raise JobError(str(exc)) from None


def resolve(target: str | None, *, err: TextIO = sys.stderr, choose: bool = False) -> Job:
    """The job named by a PID or a socket path; with none, the only one (or, with `choose` on a
    terminal, the one the user picks from the list)."""
    if target is not None:
        if target.isdigit():
            pid = int(target)
            path = socket_path(pid)
            try:
                served = existing_dir() is not None and os.path.exists(path)
            except UnsafeDirectory as exc:
                raise JobError(str(exc)) from None
            if not served:
                alive = "is running but serves no gputui socket" if pid_alive(pid) else "is not running"
                raise JobError(f"process {pid} {alive} (gputui jobs lists the jobs you can attach to)")
            return Job(pid, path)
        try:
            check_socket(target)
        except FileNotFoundError:
            raise JobError(f"no such job or socket: {target}") from None
        except UnsafeDirectory as exc:
            raise JobError(str(exc)) from None
        except OSError as exc:
            raise JobError(f"cannot use {target}: {exc.strerror or exc}") from None
        stem = os.path.basename(target).partition(".")[0]
        return Job(int(stem) if stem.isdigit() else 0, target)
    jobs = _jobs()
    if not jobs:
        raise JobError(f"no running gputui jobs of yours (sockets live in {socket_dir()})")
    if len(jobs) == 1:
        return jobs[0]
    if not (choose and sys.stdin.isatty()):
        rows = "\n".join(f"  {j.pid}  {j.path}" for j in jobs)
        raise JobError(f"{len(jobs)} jobs are running; name one (PID or socket):\n{rows}")
    offered = _grouped([row(job) for job in jobs])  # the ranks of a torchrun job together, each saying its rank
    for i, r in enumerate(offered, 1):
        err.write(f"  [{i}] {r['summary']}\n")
    answer = input(f"attach to which job? [1-{len(offered)}] ").strip()
    if not answer.isdigit() or not 1 <= int(answer) <= len(offered):
        raise JobError(f"not a job number: {answer!r}")
    chosen = offered[int(answer) - 1]
    return Job(chosen["pid"], chosen["socket"])


def connect(job: Job, *, control: bool = False, timeout: float = 5.0) -> Connection:
    try:
        return Connection(job.path, control=control, timeout=timeout)
    except ForeignPeer as exc:
        raise JobError(f"refusing {job.path}: {exc}") from None
    except PermissionError:
        raise JobError(f"cannot connect to {job.path}: permission denied (another user's job?)") from None
    except (ConnectionRefusedError, FileNotFoundError):
        raise JobError(f"job {job.pid} is not answering on {job.path} (it may have just ended)") from None
    except OSError as exc:
        raise JobError(f"cannot connect to {job.path}: {exc.strerror or exc}") from None


def row(job: Job) -> dict[str, Any]:
    """One job as `gputui jobs` shows it (reading its welcome, at most two seconds)."""
    try:
        with connect(job, timeout=1.0) as conn:
            welcome = conn.welcome(timeout=2.0)
    except JobError as exc:
        error = str(exc)
    except (OSError, ProtocolError) as exc:
        error = str(_failed(job, exc))
    else:
        return _row(job, welcome)
    return {
        "pid": job.pid,
        "socket": job.path,
        "error": error,
        "summary": f"{job.pid:>7}  {'?':<16} {'-':<8} {'no answer':<9} {'-':>11}  {'-':>9}  {job.path}",
    }


def _row(job: Job, welcome: Welcome) -> dict[str, Any]:
    hello = welcome.hello or {}
    info = welcome.info
    argv = list(info.argv if info else ()) or hello.get("argv") or ["?"]
    latest = welcome.latest
    summary = hello.get("summary")
    state = RunSummary.from_json(summary).outcome if summary else "starting" if info is None else "training"
    if state == "training" and hello.get("idle_since"):  # the script works outside a step (evaluates, saves)
        state = "between"
    if state == "training" and _paused(welcome):
        state = "paused"
    waiting = None if summary else _waiting(welcome)
    if waiting is not None:
        state = "waiting"
    data: dict[str, Any] = {
        "pid": job.pid,
        "script": os.path.basename(argv[0]),
        "args": argv[1:],
        "device": info.device if info else None,
        "device_name": info.device_name if info else None,
        "state": state,
        "step": None if latest is None else latest.step,
        "total_steps": info.total_steps if info else None,
        "rank": info.rank if info else None,
        "world_size": info.world_size if info else None,
        "job": info.job if info else None,
        "loss": None if latest is None else latest.loss,
        "waiting": waiting,
        "uptime_s": round(time.time() - (hello.get("server_started") or time.time()), 1),
        "socket": job.path,
    }
    step = (
        "-" if data["step"] is None else f"{data['step']}" + (f"/{data['total_steps']}" if data["total_steps"] else "")
    )
    script = data["script"][:40]
    if info is not None and info.world_size > 1:  # a torchrun rank: which one, bounded as the other cells
        script += f" rank {info.rank}/{info.world_size}"[:24]
    data["summary"] = (
        f"{job.pid:>7}  {script:<16} {(data['device'] or '-')[:20]:<8} {state:<9} "
        f"{step:>11}  {format_duration(data['uptime_s']):>9}  {job.path}" + (f"  ({waiting})" if waiting else "")
    )
    return data


def _paused(welcome: Welcome) -> bool:
    """Whether the job's last pause (`p`, or an OOM with auto-recover off) has not been resumed."""
    for record in reversed(welcome.events):
        if record.get("name") in ("paused", "resumed"):
            return record["name"] == "paused"
    return False


def _waiting(welcome: Welcome) -> str | None:
    """What a torchrun rank waits for, where its last `rank_waiting` came after its last step."""
    latest = welcome.latest
    for record in reversed(welcome.events):
        if record.get("name") == "rank_waiting":
            event = Event.from_json(record)
            if latest is None or event.step >= latest.step:  # counted on from when it was said
                return waiting_text(event, float(event["waited_s"]) + max(0.0, time.time() - event.t))
            return None
    return None


def _grouped(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows with the ranks of each torchrun job together (where its first-listed rank was), in
    rank order: under torchrun every rank serves its own socket, and the sockets are listed by name."""
    first: dict[str, int] = {}
    keys = [(first.setdefault(r["job"], i), r.get("rank") or 0) if r.get("job") else (i, 0) for i, r in enumerate(rows)]
    return [rows[i] for i in sorted(range(len(rows)), key=keys.__getitem__)]


def list_jobs(as_json: bool, out: TextIO, err: TextIO = sys.stderr) -> int:
    """Every job, one row each; 1 (after listing the others, each failure one line on `err`) if
    some job could not be read."""
    rows = _grouped([row(job) for job in _jobs()])
    if as_json:
        out.write(json.dumps([{k: v for k, v in r.items() if k != "summary"} for r in rows], indent=2) + "\n")
    elif not rows:
        out.write(f"no running gputui jobs of yours (sockets live in {socket_dir()})\n")
    else:
        out.write(f"{'PID':>7}  {'SCRIPT':<16} {'DEVICE':<8} {'STATE':<9} {'STEP':>11}  {'UPTIME':>9}  SOCKET\n")
        for r in rows:
            out.write(r["summary"] + "\n")
    failed = [r["error"] for r in rows if "error" in r]
    for error in failed:
        err.write(f"gputui: error: {error}\n")
    return 1 if failed else 0


def attach_json(job: Job, out: TextIO) -> int:
    """The latest sample (or, before the first step, who the job is) as one JSON document."""
    with connect(job) as conn:
        try:
            welcome = conn.welcome()
        except (OSError, ProtocolError) as exc:
            raise _failed(job, exc) from None
    record = {"kind": "hello", **(welcome.hello or {})} if welcome.latest is None else welcome.latest.to_json()
    out.write(json.dumps(record, indent=2) + "\n")
    return 0


# ctl words -> (action, value words -> values): each control action, its word without "set_"
_CTL: dict[str, tuple[str, dict[str, Any] | None]] = {
    action.removeprefix("set_").replace("_", "-"): (
        action,
        None
        if allowed is None
        else {"on": True, "off": False}
        if allowed == (True, False)
        else {str(v): v for v in allowed},
    )
    for action, allowed in ACTIONS.items()
}
CTL_ACTIONS = ", ".join(f"{word} {'|'.join(v[1])}" if isinstance(v[1], dict) else word for word, v in _CTL.items())


def parse_ctl(words: list[str]) -> tuple[str, Any]:
    if not words or words[0] not in _CTL:
        raise JobError(f"unknown action {' '.join(words)!r}; one of: {CTL_ACTIONS}")
    action, values = _CTL[words[0]]
    if values is None:
        if len(words) > 1:
            raise JobError(f"{words[0]} takes no value")
        return action, None
    if len(words) != 2 or words[1] not in values:
        raise JobError(f"{words[0]} takes one of {', '.join(values)}")
    return action, values[words[1]]


def ctl(job: Job, words: list[str], *, timeout: float, out: TextIO) -> int:
    """Send one control and say what the job applied; 0 applied, 1 refused, not applied in time, or
    never to be: the run ended first (or had, with the script still running: no boundary is coming)."""
    action, value = parse_ctl(words)
    with connect(job, control=True) as conn:
        try:
            welcome = conn.welcome()
            hello = welcome.hello or {}
            ended = hello.get("summary")
            if ended is not None:
                out.write(_ended(job, ended) + "\n")
                return 1
            ack = _acked(conn, conn.request(action, value))
            if action == "stop":  # applied after the current step; the job then ends
                out.write(f"job {job.pid}: stop requested; it stops after the current step\n")
                return 0
            idle = hello.get("idle_since")
            answer = {"kind": "idle", "since": idle} if idle else wait_for_answer(conn, ack["request_id"], timeout)
        except (OSError, ProtocolError) as exc:
            raise _failed(job, exc) from None
    if answer is None:
        out.write(
            f"job {job.pid}: requested, not applied within {timeout:g} s (a long step, or paused "
            "waiting elsewhere?); it applies at the next step boundary\n"
        )
        return 1
    if answer["kind"] == "idle":  # no step boundary until the script trains again (a fit call, trainer.step())
        after = f"after step {welcome.latest.step}, " if welcome.latest is not None else ""
        out.write(
            f"job {job.pid}: between steps ({after}{time.time() - answer['since']:.0f} s outside a step): "
            "requested; it applies when training resumes\n"
        )
        return 1
    if answer["kind"] != "event":
        out.write(_ended(job, answer.get("summary")) + "\n")
        return 1
    event = Event.from_json(answer)
    out.write(f"job {job.pid}: after step {event.step}: {describe(event)}\n")
    if event.name == "plan":
        out.writelines(line + "\n" for line in plan_lines(event))
    return 1 if event.name == "control_refused" else 0


def _ended(job: Job, summary: dict[str, Any] | None) -> str:
    """No boundary will apply the request: the job's run ended (its end record's `summary`), or the job
    closed the connection without one."""
    if summary is None:
        return f"job {job.pid} ended before applying it (the connection closed without its final record)"
    s = RunSummary.from_json(summary)
    how = f"stopped: {s.stopped}" if s.stopped else f"failed: {s.error}" if s.error else "finished"
    return f"job {job.pid}: its run ended before applying it ({how}, after step {s.steps})"


def _acked(conn: Connection, ident: int) -> dict[str, Any]:
    """The job's ack of request `ident` (read past live records); JobError if refused or not in ACK_WAIT s."""
    deadline = time.monotonic() + ACK_WAIT
    while deadline > time.monotonic():
        try:
            record = conn.read(deadline)
        except TimeoutError:
            break
        if record is None:
            raise JobError("the job closed the connection before answering")
        if record["kind"] == "error" and record.get("id") == ident:
            raise JobError(f"refused: {' '.join(str(record.get('reason')).split())}")
        if record["kind"] == "ack" and record.get("id") == ident and record.get("request_id") is not None:
            return record
    raise JobError(f"the job did not acknowledge the request within {ACK_WAIT:g} s")
