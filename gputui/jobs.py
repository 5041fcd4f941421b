"""`gputui jobs`, `gputui attach --json` and `gputui ctl`: talking to running jobs without the TUI.

No torch here: these start in a fraction of a second on a login node or in a tmux pane.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from typing import Any, TextIO

from .telemetry.client import Connection, Welcome, wait_for_answer
from .telemetry.controls import ACTIONS
from .telemetry.describe import describe
from .telemetry.paths import Job, find_jobs, pid_alive, socket_dir, socket_path
from .telemetry.protocol import ProtocolError
from .telemetry.sample import Event


class JobError(Exception):
    """A job cannot be found or reached; the message is the one line the user sees."""


def resolve(target: str | None, *, err: TextIO = sys.stderr, choose: bool = False) -> Job:
    """The job named by a PID or a socket path; with none, the only one (or, with `choose` on a
    terminal, the one the user picks from the list)."""
    if target is not None:
        if target.isdigit():
            pid = int(target)
            path = socket_path(pid)
            if not os.path.exists(path):
                alive = "is running but serves no gputui socket" if pid_alive(pid) else "is not running"
                raise JobError(f"process {pid} {alive} (gputui jobs lists the jobs you can attach to)")
            return Job(pid, path)
        if os.path.exists(target):
            stem = os.path.basename(target).partition(".")[0]
            return Job(int(stem) if stem.isdigit() else 0, target)
        raise JobError(f"no such job or socket: {target}")
    jobs = find_jobs()
    if not jobs:
        raise JobError(f"no running gputui jobs of yours (sockets live in {socket_dir()})")
    if len(jobs) == 1:
        return jobs[0]
    if not (choose and sys.stdin.isatty()):
        rows = "\n".join(f"  {j.pid}  {j.path}" for j in jobs)
        raise JobError(f"{len(jobs)} jobs are running; name one (PID or socket):\n{rows}")
    for i, job in enumerate(jobs, 1):
        err.write(f"  [{i}] {row(job)['summary']}\n")
    answer = input(f"attach to which job? [1-{len(jobs)}] ").strip()
    if not answer.isdigit() or not 1 <= int(answer) <= len(jobs):
        raise JobError(f"not a job number: {answer!r}")
    return jobs[int(answer) - 1]


def connect(job: Job, *, control: bool = False, timeout: float = 5.0) -> Connection:
    try:
        return Connection(job.path, control=control, timeout=timeout)
    except PermissionError:
        raise JobError(f"cannot connect to {job.path}: permission denied (another user's job?)") from None
    except (ConnectionRefusedError, FileNotFoundError):
        raise JobError(f"job {job.pid} is not answering on {job.path} (it may have just ended)") from None
    except OSError as exc:
        raise JobError(f"cannot connect to {job.path}: {exc.strerror or exc}") from None


def _uptime(seconds: float) -> str:
    seconds = int(seconds)
    days, rest = divmod(seconds, 86400)
    h, rest = divmod(rest, 3600)
    return (f"{days}d" if days else "") + f"{h:02d}:{rest // 60:02d}:{rest % 60:02d}"


def row(job: Job) -> dict[str, Any]:
    """One job as `gputui jobs` shows it (reading its welcome, at most a second)."""
    try:
        with connect(job, timeout=1.0) as conn:
            welcome = conn.welcome()
    except (JobError, OSError, ProtocolError, ConnectionError) as exc:
        return {"pid": job.pid, "socket": job.path, "error": str(exc), "summary": f"{job.pid}  not answering"}
    return _row(job, welcome)


def _row(job: Job, welcome: Welcome) -> dict[str, Any]:
    hello = welcome.hello or {}
    info = welcome.info
    argv = info.get("argv") or hello.get("argv") or ["?"]
    latest = welcome.latest or {}
    summary = hello.get("summary")
    state = ("failed" if summary.get("error") else "stopped" if summary.get("stopped") else "finished") \
        if summary else "training" if info else "starting"
    data = {"pid": job.pid, "script": os.path.basename(argv[0]), "args": argv[1:],
            "device": info.get("device"), "device_name": info.get("device_name"), "state": state,
            "step": latest.get("step"), "total_steps": info.get("total_steps"), "loss": latest.get("loss"),
            "uptime_s": round(time.time() - hello.get("server_started", time.time()), 1), "socket": job.path}
    step = "-" if data["step"] is None else f"{data['step']}" + (f"/{data['total_steps']}" if data["total_steps"] else "")
    data["summary"] = (f"{job.pid:>7}  {data['script']:<16} {data['device'] or '-':<8} {state:<9} {step:>11}  "
                       f"{_uptime(data['uptime_s']):>9}  {job.path}")
    return data


def list_jobs(as_json: bool, out: TextIO) -> int:
    rows = [row(job) for job in find_jobs()]
    if as_json:
        out.write(json.dumps([{k: v for k, v in r.items() if k != "summary"} for r in rows], indent=2) + "\n")
        return 0
    if not rows:
        out.write(f"no running gputui jobs of yours (sockets live in {socket_dir()})\n")
        return 0
    out.write(f"{'PID':>7}  {'SCRIPT':<16} {'DEVICE':<8} {'STATE':<9} {'STEP':>11}  {'UPTIME':>9}  SOCKET\n")
    for r in rows:
        out.write(r["summary"] + "\n")
    return 0


def attach_json(job: Job, out: TextIO) -> int:
    """The latest sample (or, before the first step, who the job is) as one JSON document."""
    with connect(job) as conn:
        welcome = conn.welcome()
    record = welcome.latest or {"kind": "hello", **(welcome.hello or {})}
    out.write(json.dumps(record, indent=2) + "\n")
    return 0


# ctl words -> (action, value words -> values): each control action, its word without "set_"
_CTL: dict[str, tuple[str, dict[str, Any] | None]] = {
    action.removeprefix("set_").replace("_", "-"): (
        action, None if allowed is None else {"on": True, "off": False} if allowed == (True, False)
        else {str(v): v for v in allowed})
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
    """Send one control and say what the job applied; 0 applied, 1 refused or not applied in time."""
    action, value = parse_ctl(words)
    with connect(job, control=True) as conn:
        conn.welcome()
        ident = conn.request(action, value)
        while (record := conn.read()) is not None:
            if record["kind"] == "error" and record.get("id") == ident:
                raise JobError(f"refused: {record.get('reason')}")
            if record["kind"] == "ack" and record.get("id") == ident:
                break
        else:
            raise JobError("the job closed the connection before answering")
        if action == "stop":  # applied after the current step; the job then ends
            out.write(f"job {job.pid}: stop requested; it stops after the current step\n")
            return 0
        try:
            answer = wait_for_answer(conn, record["request_id"], timeout)
        except (OSError, socket.timeout):
            answer = None
    if answer is None:
        out.write(f"job {job.pid}: requested, not applied within {timeout:g} s (a long step, or paused "
                  "waiting elsewhere?); it applies at the next step boundary\n")
        return 1
    event = Event.from_json(answer)
    out.write(f"job {job.pid}: after step {event.step}: {describe(event)}\n")
    return 1 if event.name == "control_refused" else 0
