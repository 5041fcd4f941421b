"""Under torchrun: `gputui.fit` against a plain DDP loop on the same MLPs (made here, in no other
file), two ranks on the CPU (gloo, one torch thread each), and what fit's exchange costs a step.

One launch (`torchrun --standalone --nproc_per_node=2`) runs everything. Per workload, blocks of a
plain DDP loop (the script wraps DistributedDataParallel itself) and blocks of `gputui.fit` take
turns, each block on its own copy of the model and optimizer (AdamW), the order swapped every pair
so a slow spell of the machine falls on both. A block's step is its steps' wall time over their
count (fit's from its requests for batches: it reads one ahead, so the first and last steps of a
call, with its setup, fall outside). A ratio is plain's step over fit's, per pair of blocks. Then a
fit run alone with its exchange, verdict and collectives timed says what fit adds a step.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import harness

# name: (layer widths, per-rank batch); about 6 ms and 20 ms a step on one thread of a recent CPU
MODELS = {"mlp-6ms": ((512, 512, 512, 512, 10), 32), "mlp-20ms": ((1024, 1024, 1024, 1024, 10), 48)}
FULL = {"blocks": 10, "steps": 100, "probe_steps": 200}
QUICK = {"blocks": 4, "steps": 30, "probe_steps": 40}
GROUP_TIMEOUT_S = 60  # a collective that waits longer fails the launch instead of hanging it
LAUNCH_TIMEOUT_S, QUICK_LAUNCH_TIMEOUT_S = 900, 300


# -- the parent: one launch, then the figures ------------------------------------------------
def run(quick: bool, device: str) -> dict[str, Any]:
    asked = harness.device_of(device)
    config = QUICK if quick else FULL
    with harness.scratch() as tmp:
        out = os.path.join(tmp, "ranks.json")
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
        argv += [os.path.abspath(__file__), "worker", out, json.dumps(config)]
        env = harness.child_env(tmp, OMP_NUM_THREADS="1")
        limit = QUICK_LAUNCH_TIMEOUT_S if quick else LAUNCH_TIMEOUT_S
        with harness.background(argv, env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
            try:
                output, _ = proc.communicate(timeout=limit)
            except subprocess.TimeoutExpired:
                proc.terminate()  # torchrun ends its workers, which lead sessions of their own (kill_tree misses them)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.communicate(timeout=40)
                raise RuntimeError(f"the torchrun launch did not end in {limit}s") from None
        if proc.returncode or not os.path.exists(out):
            raise RuntimeError(f"the torchrun launch failed ({proc.returncode}): {output[-3000:]}")
        with open(out) as f:
            raw = json.load(f)
    return {
        "device": "cpu",
        "asked": asked,
        "world_size": raw["world_size"],
        "backend": raw["backend"],
        "threads": raw["threads"],
        "blocks": config["blocks"],
        "steps": config["steps"],
        "workloads": {name: figures(w) for name, w in raw["workloads"].items()},
        "probe": raw["probe"],
    }


def figures(w: dict[str, Any]) -> dict[str, Any]:
    """Each loop's step (ms) over its blocks, and plain's step over fit's per pair of blocks."""
    plain, fit = w["plain"], w["fit"]
    return {
        "batch": w["batch"],
        "params": w["params"],
        "step_ms": {"plain": harness.summary([1e3 * t for t in plain]), "fit": harness.summary([1e3 * t for t in fit])},
        "ratio": harness.summary([p / f for p, f in zip(plain, fit, strict=True)]),
        "added_us": harness.summary([1e6 * (f - p) for p, f in zip(plain, fit, strict=True)]),
    }


def markdown(r: dict[str, Any]) -> str:
    where = f"{r['world_size']} ranks on the CPU ({r['backend']}, {r['threads']} torch thread each)"
    if r["asked"] != "cpu":
        where += f" ({r['asked']} asked: NCCL is not measured, its two ranks would need a GPU each)"
    lines = [
        f"{where}. Blocks of {r['steps']} steps of a plain DDP loop and of `gputui.fit` take turns, "
        f"{r['blocks']} of each. Step: median (min-max) over the blocks. Ratio: the plain step over fit's, "
        "per pair of blocks (fit's share of plain's samples/s).",
        "",
        "| workload (batch a rank) | plain step (ms) | fit step (ms) | ratio | fit adds (us) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, w in r["workloads"].items():
        step = w["step_ms"]
        lines.append(
            f"| {name}, {w['params'] / 1e6:.2f}M params ({w['batch']}) | {harness.spread(step['plain'])} | "
            f"{harness.spread(step['fit'])} | **{harness.spread(w['ratio'])}** | {harness.spread(w['added_us'])} |"
        )
    p = r["probe"]
    per_step = ", ".join(
        f"{c['name']} of {c['numel']} {c['dtype']} x{c['per_step']:.3g} ({harness.fmt(c['us']['median'])} us)"
        for c in p["collectives"]
    )
    agree = p.get("agree_valid_us", {})
    lines += [
        "",
        f"fit's own collectives ({p['steps']} steps of {p['workload']} through fit alone, rank 0, each call's "
        f"median): {per_step or 'none'} (x: calls a step). Under fit's own DDP on gloo a step exchanges only "
        "when some rank marked DDP's last gradient bucket (news: a control, a stop, a changed batch or "
        "micro-batch, its data ending) or for the ranks' rows about once a second, and the synced backward's "
        "verdict rides on that bucket; each exchange waited "
        f"{harness.spread(p.get('finish_us', {}))} us, waiting for the other rank included"
        + (f"; the verdict's own all_reduce (agree_valid) {harness.spread(agree)} us." if agree.get("median") else "."),
    ]
    return "\n".join(lines)


# -- a rank: what torchrun runs ----------------------------------------------------------------
def worker(out: str, config: dict[str, Any]) -> None:
    import datetime
    import gc

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    try:
        result: dict[str, Any] = {
            "world_size": dist.get_world_size(),
            "backend": dist.get_backend(),
            "threads": torch.get_num_threads(),
            "workloads": {name: blocks(name, config["blocks"], config["steps"]) for name in MODELS},
            "probe": probe(next(iter(MODELS)), config["probe_steps"]),
        }
        if dist.get_rank() == 0:
            from workloads import write

            write(out, result)
    finally:
        gc.collect()  # DDP wrappers before their group (see gputui/engine/strategies/group.py's _destroy)
        dist.destroy_process_group()


def make(name: str) -> tuple[Any, list[Any], Any]:
    """(model, batches, step) of a workload: an MLP on random data, the same on every rank."""
    import torch
    from torch import nn

    widths, batch = MODELS[name]
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for a, b in zip(widths[:-2], widths[1:-1], strict=True):
        layers += [nn.Linear(a, b), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Linear(widths[-2], widths[-1]))
    data = [(torch.randn(batch, widths[0]), torch.randint(widths[-1], (batch,))) for _ in range(8)]

    def step(m: Any, b: Any) -> Any:
        return nn.functional.cross_entropy(m(b[0]), b[1])

    return model, data, step


class Requests:
    """`count` batches (cycling), each request's time kept: fit asks for batch k+1 as step k starts."""

    def __init__(self, batches: list[Any], count: int) -> None:
        self.batches, self.count, self.times = batches, count, []

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[Any]:
        for i in range(self.count):
            self.times.append(time.perf_counter())
            yield self.batches[i % len(self.batches)]


def blocks(name: str, count: int, steps: int) -> dict[str, Any]:
    """`count` blocks of each loop taking turns (one of each untimed first); each block's step (s)."""
    import copy

    import torch
    from torch.nn.parallel import DistributedDataParallel

    import gputui

    model, data, step = make(name)
    plain_model = DistributedDataParallel(copy.deepcopy(model))
    plain_opt = torch.optim.AdamW(plain_model.parameters(), lr=1e-4)
    fit_opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def plain() -> float:
        start = time.perf_counter()
        for i in range(steps):
            step(plain_model, data[i % len(data)]).backward()
            plain_opt.step()
            plain_opt.zero_grad(set_to_none=True)
        return (time.perf_counter() - start) / steps

    def fit() -> float:
        requests = Requests(data, steps + 3)
        gputui.fit(model, requests, step, fit_opt, device="cpu", max_steps=steps + 2)
        t = requests.times
        return (t[steps + 1] - t[1]) / steps

    times: dict[str, list[float]] = {"plain": [], "fit": []}
    for i in range(count + 1):
        order = [("plain", plain), ("fit", fit)] if i % 2 else [("fit", fit), ("plain", plain)]
        for loop, run_block in order:
            took = run_block()
            if i:  # the first pair warms up
                times[loop].append(took)
    params = sum(p.numel() for p in model.parameters())
    return {"batch": MODELS[name][1], "params": params, **times}


def probe(name: str, steps: int) -> dict[str, Any]:
    """A fit run alone with torch.distributed's calls and fit's exchange timed: which collectives fit
    adds a step (DDP's own gradient all-reduce goes through its reducer, not these functions)."""
    import torch
    import torch.distributed as dist

    import gputui
    from gputui.engine.strategies.exchange import Agreement
    from gputui.engine.strategies.wrapper import Distributed

    calls: list[tuple[str, int, str, float]] = []
    methods: dict[str, list[float]] = {"finish": [], "agree_valid": []}
    owners = {"finish": Agreement, "agree_valid": Distributed}

    def timed(fn: Any, note: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                note(time.perf_counter() - start, args)

        return wrapper

    def collective(kind: str) -> Any:
        def note(t: float, args: Any) -> None:
            tensor = args[0]
            if tensor.numel() < 1000:  # fit's own (DDP's gradient buckets are far larger)
                calls.append((kind, tensor.numel(), str(tensor.dtype).split(".")[-1], t))

        return note

    originals = {kind: getattr(dist, kind) for kind in ("all_reduce", "broadcast")}
    own = {kind: getattr(owners[kind], kind) for kind in methods if hasattr(owners[kind], kind)}  # older: none
    for kind, fn in originals.items():
        setattr(dist, kind, timed(fn, collective(kind)))
    for kind, fn in own.items():
        setattr(owners[kind], kind, timed(fn, lambda t, args, kind=kind: methods[kind].append(t)))
    model, data, step = make(name)
    try:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        done = gputui.fit(model, Requests(data, steps), step, optimizer, device="cpu").steps
    finally:
        for kind, fn in originals.items():
            setattr(dist, kind, fn)
        for kind, fn in own.items():
            setattr(owners[kind], kind, fn)
    seen: dict[tuple[str, int, str], list[float]] = {}
    for kind, numel, dtype, t in calls:
        seen.setdefault((kind, numel, dtype), []).append(t)
    return {
        "workload": name,
        "steps": done,
        "collectives": [
            {
                "name": kind,
                "numel": numel,
                "dtype": dtype,
                "per_step": len(ts) / done,
                "us": harness.summary([1e6 * t for t in ts]),
            }
            for (kind, numel, dtype), ts in seen.items()
        ],
        **{f"{kind}_us": harness.summary([1e6 * t for t in ts]) for kind, ts in methods.items()},
    }


if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"]:
        worker(sys.argv[2], json.loads(sys.argv[3]))
    else:
        harness.main(run, __doc__)
