"""What fit adds to a step in instructions, not time: on a machine whose timings wander (a shared VM,
where the same step takes 2.5 ms one minute and 4 ms the next), a 2 % difference between fit and a
plain loop is below what any timing resolves, but valgrind counts what a step executes the same on
every run. Each loop runs under callgrind with collection off until the request of batch WARMUP and off
again at the request of batch WARMUP+N: the count is N whole steps, fit's bookkeeping included, and
nothing of the process's start or end (which moved a whole run's count by ~10 M instructions from one
run to the next). The window is opened and closed by callgrind's client requests, from a few lines of C
built here with the system's compiler (valgrind's headers come with Debian's valgrind package). The
clocks fit reads run on the process's CPU time, paced to a native step (Clocks), so what fit paces by
time (readings, flushes, checks) comes as often a step as it does natively, however busy the machine is.

    python benchmarks/fit_instructions.py                 # the tiny MLP at batch 32, 200 steps
    python benchmarks/fit_instructions.py --batch 832 --out benchmarks/INSTRUCTIONS.md

The garbage collector is off in both loops (what fit's garbage costs is not in the figures). Instructions
are not time: a step's memory misses are not in them (the D1 misses are shown, from callgrind's cache
model). They say whether a change made fit's own work smaller, which timings here cannot.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import harness

WARMUP = 30
PACED_FROM = 10
"""The warm-up steps from PACED_FROM to WARMUP set the clocks' pace (below)."""


class Clocks:
    """The clocks fit reads (time.monotonic, time.time, time.perf_counter), run on the process's CPU time
    and slowed so that a step takes as long on them as it does natively (`step_s`): what fit paces by time
    (readings, flushes, its periodic checks) then comes as often a step as in a native run, however slow
    valgrind is and whatever else the machine runs meanwhile. Until the warm-up has set the pace, valgrind
    is taken to be 50 times slower. A change of pace keeps the clocks continuous (never going back)."""

    def __init__(self, step_s: float) -> None:
        self.step_s, self.slowdown = step_s, 50.0
        self.cpu, self.at, self.wall = time.process_time(), 0.0, time.time()
        for name in ("monotonic", "time", "perf_counter"):
            setattr(time, name, self.wall_now if name == "time" else self.now)

    def now(self) -> float:
        return self.at + (time.process_time() - self.cpu) / self.slowdown

    def wall_now(self) -> float:
        return self.wall + self.now()

    def pace(self, cpu_per_step: float) -> None:
        self.at, self.cpu = self.now(), time.process_time()
        self.slowdown = cpu_per_step / self.step_s


WINDOW_C = """
#include <valgrind/callgrind.h>
void window(void) { CALLGRIND_TOGGLE_COLLECT; }
"""
"""Callgrind's collection switched on or off: a client request is a marked instruction sequence, so it is
made from C (a no-op outside valgrind)."""


def build_window(tmp: str) -> str:
    """The window's shared library, built in `tmp`: its path."""
    source, library = os.path.join(tmp, "window.c"), os.path.join(tmp, "window.so")
    with open(source, "w") as f:
        f.write(WINDOW_C)
    proc = subprocess.run(["cc", "-O1", "-shared", "-fPIC", "-o", library, source], capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"fit_instructions: could not build the collection window: {proc.stderr.strip().splitlines()[-1]}")
    return library


class Windowed:
    """The batches, collection switched on at the request of batch WARMUP and off at that of WARMUP+steps,
    the clocks' pace set at WARMUP from the warm-up steps since PACED_FROM."""

    def __init__(self, batches: list, steps: int, window: ctypes.CDLL, clocks: Clocks) -> None:
        self.batches, self.steps, self.window, self.clocks = batches, steps, window, clocks

    def __len__(self) -> int:
        return WARMUP + self.steps + 1

    def __iter__(self):
        for i in range(len(self)):
            if i == PACED_FROM:
                paced_from = time.process_time()
            elif i == WARMUP:
                self.clocks.pace((time.process_time() - paced_from) / (WARMUP - PACED_FROM))
            if i in (WARMUP, WARMUP + self.steps):
                self.window.window()
            yield self.batches[i % len(self.batches)]


def child(kind: str, steps: int, batch: int, library: str, step_s: float) -> None:
    """One loop's run, inside valgrind."""
    clocks = Clocks(step_s)
    import torch
    import workloads

    torch.set_num_threads(1)
    w = workloads.make("mlp", batch=batch)
    data = Windowed(w.batches, steps, ctypes.CDLL(library), clocks)
    # The collector off: its collections come by allocation counts and land in one run's window and not the
    # other's (a plain step's count moved by ~90 k instructions, 1.5 %, between two runs with it on).
    gc.disable()
    if kind == "fit":
        import gputui

        gputui.fit(w.model, data, w.step, w.optimizer())
        return
    workloads.plain_loop(w, data)


def native_step_s(batch: int, steps: int = 300) -> float:
    """CPU seconds a plain step takes here, natively (the pace the clocks under valgrind keep)."""
    import torch
    import workloads

    torch.set_num_threads(1)
    w = workloads.make("mlp", batch=batch)
    marks: list[float] = []

    def batches():
        for i in range(WARMUP + steps + 1):
            if i in (WARMUP, WARMUP + steps):
                marks.append(time.process_time())
            yield w.batches[i % len(w.batches)]

    workloads.plain_loop(w, batches())
    return (marks[1] - marks[0]) / steps


def counted(kind: str, steps: int, batch: int, step_s: float, library: str, tmp: str, run: int) -> tuple[int, int]:
    """(instructions, D1 misses) of one run's window under callgrind."""
    out = os.path.join(tmp, f"cg.{kind}.{run}")
    # One hash seed: with a random one, dicts and sets lay out differently in every process, and a step's
    # count moves with them.
    env = {**harness.child_env(tmp), "PYTHONUNBUFFERED": "1", "PYTHONHASHSEED": "0"}
    proc = subprocess.run(
        ["valgrind", "--tool=callgrind", "--collect-atstart=no", "--cache-sim=yes", f"--callgrind-out-file={out}",
         sys.executable, __file__, "--child", kind, str(steps), library, "--batch", str(batch),
         "--step-s", repr(step_s)],
        env=env, capture_output=True, text=True, timeout=3600,
    )  # fmt: skip
    if proc.returncode:
        raise RuntimeError(f"the {kind} run failed under valgrind ({proc.returncode}): {proc.stderr[-1500:]}")
    with open(out) as f:
        text = f.read()
    events, totals = re.search(r"^events: (.+)$", text, re.M), re.search(r"^(?:totals|summary): (.+)$", text, re.M)
    if events is None or totals is None:
        raise RuntimeError(f"no totals in callgrind's output: {text[-800:]}")
    figures = dict(zip(events.group(1).split(), map(int, totals.group(1).split()), strict=True))
    return figures["Ir"], figures["D1mr"] + figures["D1mw"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=200, help="steps counted in each run (after WARMUP)")
    parser.add_argument("--runs", type=int, default=2, help="runs of each loop (their spread is shown)")
    parser.add_argument("--out", help="a Markdown file the figures are written to (else printed only)")
    parser.add_argument("--keep", metavar="DIR", help="callgrind's outputs kept here (callgrind_annotate reads them)")
    parser.add_argument(
        "--step-ms", type=float, help="the native step the clocks keep pace with (default: a plain step here, measured)"
    )
    parser.add_argument("--step-s", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--child", nargs=3, metavar=("KIND", "STEPS", "LIBRARY"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]), args.batch, args.child[2], args.step_s)
        return
    for tool in ("valgrind", "cc"):
        if shutil.which(tool) is None:
            sys.exit(f"fit_instructions: {tool} is not installed (Debian: apt install valgrind gcc)")
    n, kinds = args.steps, ("plain", "fit")
    step_s = args.step_ms / 1e3 if args.step_ms else native_step_s(args.batch)
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(max_workers=2) as pool:
        library = build_window(tmp)
        runs = {
            k: [pool.submit(counted, k, n, args.batch, step_s, library, tmp, r) for r in range(args.runs)]
            for k in kinds
        }
        per_step = {k: [(i / n, d / n) for i, d in (f.result() for f in runs[k])] for k in kinds}
        if args.keep:
            os.makedirs(args.keep, exist_ok=True)
            for name in os.listdir(tmp):
                if name.startswith("cg."):
                    shutil.copy(os.path.join(tmp, name), args.keep)
    mean = {k: (sum(i for i, _ in v) / len(v), sum(d for _, d in v) / len(v)) for k, v in per_step.items()}
    (plain_i, plain_d), (fit_i, fit_d) = mean["plain"], mean["fit"]
    spread = {k: ", ".join(f"{i:,.0f}" for i, _ in per_step[k]) for k in kinds}
    from run import machine

    m = machine("cpu")
    lines = [
        "# fit's instructions a step (callgrind)\n",
        f"Made by `python benchmarks/fit_instructions.py --batch {args.batch} --steps {n} --runs {args.runs}"
        f"{f' --step-ms {args.step_ms}' if args.step_ms else ''}` on "
        f"{m['date']}: {m['cpu']}, {m['cores']} cores; Python {m['python']}, torch {m['torch']}, gputui at commit "
        f"{m['commit']}.\n",
        f"demos/mlp.py tiny (width 32, depth 2), batch {args.batch}, AdamW, torch on one thread; {n} steps counted "
        f"after {WARMUP} in each of {args.runs} runs of each loop (the mean; each run's figure in brackets); fit's "
        f"clocks kept the pace of a {step_s * 1e3:.2f} ms step.\n",
        "| loop | instructions a step | D1 misses a step |",
        "| --- | --- | --- |",
        f"| plain PyTorch loop | {plain_i:,.0f} [{spread['plain']}] | {plain_d:,.0f} |",
        f"| gputui.fit | {fit_i:,.0f} [{spread['fit']}] | {fit_d:,.0f} |",
        f"| fit adds | **{fit_i - plain_i:,.0f}** ({(fit_i - plain_i) / plain_i:.2%}) | {fit_d - plain_d:,.0f} |",
        "",
        f"Instructions of a plain step to fit's: **{plain_i / fit_i:.4f}**.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
