"""What fit adds to a step in instructions, not time: on a machine whose timings wander (a shared VM,
where the same step takes 2.5 ms one minute and 4 ms the next), a 2 % difference between fit and a
plain loop is below what any timing resolves, but cachegrind counts what a step executes the same on
every run. Each loop runs under valgrind twice, N and 2N timed steps after the same warm-up: the
difference is N steps, the process's start and the run's end cancelled. The clocks fit reads run on the
process's CPU time slowed by the valgrind slowdown, so what fit paces by time (readings, flushes,
checks) comes as often a step as it does natively, however busy the machine is.

    python benchmarks/fit_instructions.py                 # the tiny MLP at batch 32, 1000 steps
    python benchmarks/fit_instructions.py --batch 832 --out benchmarks/INSTRUCTIONS.md

A process's own count moves by about 10 M instructions from one run to the next (its start), so N
must be large: at N=100 a step's figure moved by ~100 k (2 %) between runs, the size of fit's whole cost;
the default N=1000 (hours under valgrind) brings that to ~10 k. The garbage collector is off in both loops (what fit's garbage costs is not in the figures). Instructions
are not time: a step's memory misses are not in them (the D1 misses are shown, from
cachegrind's cache model). They say whether a change made fit's own work smaller, which timings here
cannot.
"""

from __future__ import annotations

import argparse
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

SLOWDOWN = 50.0
"""About how much slower a step runs under cachegrind: the clocks fit reads run this much slower."""

WARMUP = 30


def child(kind: str, steps: int, batch: int) -> None:
    """One loop's run, inside valgrind."""
    # The process's CPU time, not the wall's: valgrind runs one thread at a time, so it is the work done, and
    # what fit paces by time comes as often a step whatever else the machine runs meanwhile.
    start, wall = time.process_time(), time.time()
    for name in ("monotonic", "time", "perf_counter"):
        offset = wall if name == "time" else 0.0
        setattr(time, name, lambda offset=offset: offset + (time.process_time() - start) / SLOWDOWN)
    import torch
    import workloads

    torch.set_num_threads(1)
    w = workloads.make("mlp", batch=batch)
    data = [w.batches[i % len(w.batches)] for i in range(WARMUP + steps)]
    # The collector off: its collections come by allocation counts and land in one run's steps and not the
    # other's (a plain step's count moved by ~90 k instructions, 1.5 %, between two runs with it on).
    gc.disable()
    if kind == "fit":
        import gputui

        gputui.fit(w.model, data, w.step, w.optimizer())
        return
    model, optimizer = w.model, w.optimizer()
    for b in data:
        loss = w.step(model, b)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def counted(kind: str, steps: int, batch: int, tmp: str) -> tuple[int, int]:
    """(instructions, D1 misses) of one run under cachegrind."""
    out = os.path.join(tmp, f"cg.{kind}.{steps}")
    # One hash seed: with a random one, dicts and sets lay out differently in every process, and a step's
    # count moves with them.
    env = {**harness.child_env(tmp), "PYTHONUNBUFFERED": "1", "PYTHONHASHSEED": "0"}
    proc = subprocess.run(
        ["valgrind", "--tool=cachegrind", "--cache-sim=yes", f"--cachegrind-out-file={out}", sys.executable,
         __file__, "--child", kind, str(steps), "--batch", str(batch)],
        env=env, capture_output=True, text=True, timeout=3600,
    )  # fmt: skip
    if proc.returncode:
        raise RuntimeError(f"the {kind} run failed under valgrind ({proc.returncode}): {proc.stderr[-1500:]}")
    figures = {}
    for name in ("I   refs", "D1  misses"):
        found = re.search(rf"{name}:\s+([\d,]+)", proc.stderr)
        if found is None:
            raise RuntimeError(f"no '{name}' in valgrind's summary: {proc.stderr[-800:]}")
        figures[name] = int(found.group(1).replace(",", ""))
    return figures["I   refs"], figures["D1  misses"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--out", help="a Markdown file the figures are written to (else printed only)")
    parser.add_argument("--child", nargs=2, metavar=("KIND", "STEPS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]), args.batch)
        return
    if shutil.which("valgrind") is None:
        sys.exit("fit_instructions: valgrind is not installed (Debian: apt install valgrind)")
    n = args.steps
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(max_workers=2) as pool:
        runs = {(k, s): pool.submit(counted, k, s, args.batch, tmp) for k in ("plain", "fit") for s in (n, 2 * n)}
        per_step = {}
        for kind in ("plain", "fit"):
            (i1, d1), (i2, d2) = runs[(kind, n)].result(), runs[(kind, 2 * n)].result()
            per_step[kind] = ((i2 - i1) / n, (d2 - d1) / n)
    (plain_i, plain_d), (fit_i, fit_d) = per_step["plain"], per_step["fit"]
    from run import machine

    m = machine("cpu")
    lines = [
        "# fit's instructions a step (cachegrind)\n",
        f"Made by `python benchmarks/fit_instructions.py --batch {args.batch} --steps {n}` on {m['date']}: "
        f"{m['cpu']}, {m['cores']} cores; Python {m['python']}, torch {m['torch']}, gputui at commit {m['commit']}.\n",
        f"demos/mlp.py tiny (width 32, depth 2), batch {args.batch}, AdamW, torch on one thread; {n} steps after "
        f"{WARMUP}, counted as the difference of a {n}- and a {2 * n}-step run of each loop.\n",
        "| loop | instructions a step | D1 misses a step |",
        "| --- | --- | --- |",
        f"| plain PyTorch loop | {plain_i:,.0f} | {plain_d:,.0f} |",
        f"| gputui.fit | {fit_i:,.0f} | {fit_d:,.0f} |",
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
