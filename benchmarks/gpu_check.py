"""The one prepared command a session lent a GPU runs: gputui's CUDA claims checked on the device, in
stages, each under its own timeout, the whole within BUDGET_S (8 minutes of device time at most).

    python3 benchmarks/gpu_check.py --out DIR          # on a machine with a CUDA device
    python3 benchmarks/gpu_check.py --list             # the stages and their timeouts; nothing runs
    python3 benchmarks/gpu_check.py --out DIR --only tests,bench    # a rerun of some stages
    python3 benchmarks/gpu_check.py --record DIR/summary.json      # its summary into RESULTS.md

Through the device tool, from the repository's root (its working tree travels, nothing is carried):

    run(command="python3 benchmarks/gpu_check.py --out $OUT/gpu", timeout_s=540)

It needs what that machine's image has: torch with CUDA, nvidia-ml-py, psutil, pytest. Not textual:
no stage draws a screen (headless runs never import it; pyproject's import contracts keep it so).
DIR receives at most the 8 files the tool brings back (FILES), each written as the run goes, so a
run cut short still leaves what it got: summary.md and summary.json (rewritten after each stage; the
summary is printed at the end), gpu_check.log (every stage's output), junit.xml (the GPU tests),
metrics.jsonl (the capped CLI run), bench/RESULTS.md and bench/results.json. The rest (snapshots,
the rank's figures) goes to a temporary folder. Without a CUDA device: one line, exit code 2.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from harness import HERE, ROOT

sys.path.insert(1, ROOT)  # gputui from this checkout: on the device nothing is installed
import gpu_verdicts as verdicts

BUDGET_S = 470  # the device call's 540 s, less the start, the summary and a margin
LEAST_S = 20  # each stage still to come keeps this much of the budget; none starts with less
GRACE_S = 10  # a stage over its time gets SIGTERM (torchrun stops its ranks), then SIGKILL
DEVICE_CALL = 'run(command="python3 benchmarks/gpu_check.py --out $OUT/gpu", timeout_s=540)'
FILES = verdicts.FILES
SECTION = "## GPU check"


@dataclass(frozen=True)
class Stage:
    name: str
    what: str
    timeout: int
    argv: Callable[[str, str], list[str]]  # (out, scratch) -> the command, run in the repository's root
    verdict: Callable[[str, str, str], verdicts.Verdict]  # (out, scratch, the stage's output)


def _py(*args: str) -> list[str]:
    return [sys.executable, *args]


GPT = ["demos/gpt.py", "--size", "large"]  # 85M parameters, a 10 GiB step at its batch of 32: over the cap

STAGES = [
    Stage(
        "env",
        "versions, the device, MIG, the allocator's backend and settings, torch's API against gputui's use",
        60,
        lambda out, tmp: _py("benchmarks/gpu_stages.py", "env", "--json", f"{tmp}/env.json"),
        verdicts.env,
    ),
    Stage(
        "costs",
        "what memory_stats(), the probe's read, mem_get_info, NVML and the allocator's history cost",
        90,
        lambda out, tmp: _py("benchmarks/cuda_costs.py", "--device", "cuda", "--json", f"{tmp}/costs.json"),
        verdicts.costs,
    ),
    Stage(
        "tests",
        "pytest tests/gpu -m gpu",
        180,
        lambda out, tmp: _py(
            "-m", "pytest", "tests/gpu", "-m", "gpu", "-p", "no:cacheprovider", "-v", "-rfEs", f"--junitxml={out}/junit.xml"
        ),
        verdicts.tests,
    ),
    Stage(
        "cli",
        f"gputui run --headless --gpu-memory-limit {verdicts.CAP} on the demo GPT, metrics written",
        90,
        lambda out, tmp: _py(
            "-m", "gputui", "run", "--headless", "--gpu-memory-limit", verdicts.CAP, "--metrics", f"{out}/metrics.jsonl",
            *GPT, "--steps", str(verdicts.CLI_STEPS),
        ),
        verdicts.cli,
    ),
    Stage(
        "history",
        "--memory-history --snapshot-dir under the same cap: the snapshot at the OOM, loaded",
        90,
        lambda out, tmp: _py(
            "-m", "gputui", "run", "--headless", "--memory-history", "--snapshot-dir", f"{tmp}/snapshots",
            "--gpu-memory-limit", verdicts.CAP, "--metrics", f"{tmp}/history.jsonl", *GPT, "--steps", "3",
        ),
        verdicts.history,
    ),
    Stage(
        "nccl",
        "torchrun --nproc-per-node 1: an NCCL rank in DDP trains through an OOM, its weights against a plain loop",
        90,
        lambda out, tmp: _py(
            "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
            "benchmarks/gpu_stages.py", "rank", "--json", f"{tmp}/rank.json",
        ),
        verdicts.nccl,
    ),
    Stage(
        "fitcost",
        "benchmarks/fit_cost.py: what fit adds to a step on the GPU, and which of its parts add it",
        90,
        lambda out, tmp: _py("benchmarks/fit_cost.py", "--device", "cuda", "--json", f"{tmp}/fitcost.json"),
        verdicts.fitcost,
    ),
    Stage(
        "bench",
        "benchmarks/run.py --only remedies,planner --device cuda: the CUDA columns",
        240,
        lambda out, tmp: _py(
            "benchmarks/run.py", "--only", "remedies,planner", "--device", "cuda", "--out", f"{out}/bench"
        ),
        verdicts.bench,
    ),
]  # fmt: skip


def run_stage(stage: Stage, out: str, scratch: str, timeout: float, env: dict[str, str]) -> dict[str, Any]:
    """The stage's command in its own process group, its output appended to the log as it comes;
    then its verdict, from what it wrote (also when it ran out of time)."""
    log = os.path.join(out, "gpu_check.log")
    with open(log, "a") as f:
        f.write(f"\n===== {stage.name}: {stage.what} (timeout {timeout:.0f} s)\n")
        f.flush()
        start = f.tell()
        t0 = time.monotonic()
        proc = subprocess.Popen(
            stage.argv(out, scratch), cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, preexec_fn=os.setpgrp
        )
        try:
            code: int | None = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            _stop(proc)
        seconds = time.monotonic() - t0
    with open(log, errors="replace") as f:
        f.seek(start)
        output = f.read()
    try:
        passed, figures, line = stage.verdict(out, scratch, output)
    except Exception as exc:  # it wrote nothing whole: what it said last says why
        passed, figures = False, {}
        line = said(output) if code != 0 else f"no figures ({type(exc).__name__}: {exc})"
    if code is None:
        status = "timed out"
    elif code == 0 and passed:
        status = "ok"
    else:
        status = "failed"
        line = f"exit code {code}: {line}" if code else line
    return {
        "name": stage.name,
        "status": status,
        "seconds": round(seconds, 1),
        "timeout": round(timeout),
        "line": line,
        "figures": figures,
    }


def _stop(proc: subprocess.Popen[Any]) -> None:
    """Its whole process group: SIGTERM, and SIGKILL after GRACE_S."""
    for sig, wait in ((signal.SIGTERM, GRACE_S), (signal.SIGKILL, None)):
        if proc.poll() is not None:
            break
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(wait)
        except subprocess.TimeoutExpired:
            continue
    if proc.poll() is None:
        proc.wait()
    try:  # a child that outlived its leader
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def said(output: str) -> str:
    """The error a stage's output ends with (a rank's, not torchrun's summary of it), else its last line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if re.search(r"\w(Error|Exception)\b|error:", line) and "ChildFailed" not in line]
    return (errors or lines or ["no output"])[-1][:300]


def child_env(scratch: str) -> dict[str, str]:
    """The stages import gputui from this checkout (nothing is installed there); job sockets under scratch."""
    runtime = os.path.join(scratch, "xdg")
    os.makedirs(runtime, mode=0o700, exist_ok=True)
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", "XDG_RUNTIME_DIR": runtime}


def commit() -> str | None:
    try:
        done = subprocess.run(["git", "-C", ROOT, "describe", "--always", "--dirty"], capture_output=True, text=True)
    except OSError:  # no git where the tree was copied to
        return None
    return done.stdout.strip() or None


def write_summary(out: str, summary: dict[str, Any]) -> str:
    """summary.json and summary.md, each replaced whole (a reader never sees half of one)."""
    text = verdicts.markdown(summary)
    for name, content in (("summary.json", json.dumps(summary, indent=1, default=str)), ("summary.md", text)):
        with open(os.path.join(out, name + ".tmp"), "w") as f:
            f.write(content)
        os.replace(os.path.join(out, name + ".tmp"), os.path.join(out, name))
    return text


def no_cuda() -> str | None:
    """The one line said on a machine without CUDA; None where there is a device."""
    try:
        import torch
    except ImportError:
        return "gpu_check: no CUDA device here (torch not installed)"
    if torch.cuda.is_available():
        return None
    return f"gpu_check: no CUDA device here (torch {torch.__version__}, cuda unavailable)"


def check(out: str, stages: list[Stage], budget: float) -> int:
    """The stages in turn, each within what is left of `budget`; 0 when every one passed."""
    os.makedirs(out, exist_ok=True)
    for name in FILES:  # DIR is this run's: a file an earlier run left must not pass for this one's
        if os.path.exists(os.path.join(out, name)):
            os.remove(os.path.join(out, name))
    deadline = time.monotonic() + budget
    summary: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit(),
        "budget_s": budget,
        "stages": [],
    }
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as scratch:
        env = child_env(scratch)
        for i, stage in enumerate(stages):
            left = deadline - time.monotonic() - LEAST_S * (len(stages) - i - 1)
            if left < LEAST_S:
                result = {"name": stage.name, "status": "skipped", "line": "no time left in the budget"}
            else:
                print(f"gpu_check: {stage.name} ({min(stage.timeout, left):.0f} s at most)", flush=True)
                result = run_stage(stage, out, scratch, min(stage.timeout, left), env)
            summary["stages"].append(result)
            if stage.name == "env" and result.get("figures"):
                summary["device"] = verdicts.device_line(result["figures"])
            summary["elapsed_s"] = round(budget - (deadline - time.monotonic()))
            write_summary(out, summary)
            print(f"gpu_check: {stage.name}: {result['status']}: {result['line']}", flush=True)
    print("\n" + write_summary(out, summary), flush=True)
    return 0 if all(s["status"] == "ok" for s in summary["stages"]) else 1


def record(path: str, results: str = os.path.join(HERE, "RESULTS.md")) -> None:
    """A summary.json's lines into the GPU check section of `results` (benchmarks/RESULTS.md)."""
    with open(path) as f:
        summary = json.load(f)
    with open(results) as f:
        text = f.read()
    with open(results, "w") as f:
        f.write(with_section(text, section(summary)))


def section(summary: dict[str, Any] | None) -> str:
    """RESULTS.md's GPU check section: the last run's summary, or that none has run yet."""
    how = (
        f"Made by `python3 benchmarks/gpu_check.py --out DIR` on a machine with a CUDA device (through the "
        f"device tool: `{DEVICE_CALL}`; a rerun of some stages: `--only NAMES`), then `python "
        f"benchmarks/gpu_check.py --record DIR/summary.json` here. Each stage runs under its own timeout, "
        f"{BUDGET_S} s in all (`--list` shows them)."
    )
    if summary is None:
        stages = "; ".join(f"{s.name}: {s.what}" for s in STAGES)
        return f"{SECTION}\n\n{how}\n\n**Not run yet**: no GPU has been lent so far. The stages: {stages}.\n"
    return f"{SECTION}\n\n{how}\n\n" + verdicts.markdown(summary, heading=False)


def _span(text: str) -> tuple[int, int] | None:
    """Where `text`'s GPU check section is: from its heading to the next `## ` heading, or the end."""
    start = text.find(f"\n{SECTION}\n")
    if start < 0:
        return None
    end = text.find("\n## ", start + 1)
    return start + 1, end + 1 if end >= 0 else len(text)


def with_section(text: str, new: str) -> str:
    """`text` with its GPU check section replaced by `new`, or `new` added at the end."""
    span = _span(text)
    if span is None:
        return text.rstrip("\n") + "\n\n" + new
    rest = text[span[1] :]
    return text[: span[0]] + new + ("\n" + rest if rest else "")


def kept_section(path: str) -> str:
    """The GPU check section of the RESULTS.md at `path` (run.py keeps it when it rewrites the file),
    or the one that says no check has run."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return section(None)
    span = _span(text)
    return section(None) if span is None else text[span[0] : span[1]].rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", metavar="DIR", help="where the summary, the log and the stages' files go")
    p.add_argument("--list", "--dry-run", action="store_true", help="print the stages and their timeouts")
    p.add_argument("--only", metavar="NAMES", help="comma-separated stages: " + ",".join(s.name for s in STAGES))
    p.add_argument("--budget", type=float, default=BUDGET_S, help=f"seconds for the whole run (default {BUDGET_S})")
    p.add_argument("--record", metavar="SUMMARY", help="write a run's summary.json into benchmarks/RESULTS.md")
    args = p.parse_args(argv)
    stages = STAGES
    if args.only:
        names = args.only.split(",")
        unknown = sorted(set(names) - {s.name for s in STAGES})
        if unknown:
            p.error(f"unknown stage(s): {', '.join(unknown)}")
        stages = [s for s in STAGES if s.name in names]
    if args.list:
        for s in stages:
            print(f"{s.name:8} {s.timeout:4d} s  {s.what}")
        print(f"budget   {args.budget:4.0f} s  the whole run; DIR gets at most: {', '.join(FILES)}")
        return 0
    if args.record:
        record(args.record)
        return 0
    if not args.out:
        p.error("--out DIR is required")
    line = no_cuda()
    if line is not None:
        print(line, file=sys.stderr)
        return 2
    # Stopped from outside: the stage under way goes with it (run_stage's finally); the summary so far stays.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    return check(os.path.abspath(args.out), stages, args.budget)


if __name__ == "__main__":
    sys.exit(main())
