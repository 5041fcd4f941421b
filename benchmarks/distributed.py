"""Under torchrun: `gputui.fit` against a plain DDP loop on the same model and data, two ranks on the
CPU (gloo, one torch thread each), and what fit's small all_reduce a step costs alone.

One launch (`torchrun --standalone --nproc_per_node=2`) runs everything. A short probe run of fit,
with torch.distributed's calls timed, finds which collectives fit adds a step. Then, per workload,
three loops take turns step by step: a plain loop (the script wraps DistributedDataParallel itself),
the same loop with fit's all_reduces added where fit makes them, and `gputui.fit` (given the
unwrapped model: fit wraps it). The plain loops' steps run inside fit's data iterator, each on its
own copy of the model, so a slow spell of the machine falls on all three. With a micro-batch of half
the batch, the plain loops accumulate the same two halves (the first under `no_sync()`). Last, fit's
all_reduces are timed alone in a loop.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import harness

if TYPE_CHECKING:
    from workloads import Workload

# name: (per-rank batch, timed steps, warm-up steps); the steps are ~3 ms and ~15-20 ms on one thread
FULL = {"mlp": (256, 2000, 100), "gpt": (4, 400, 20)}
QUICK = {"mlp": (256, 300, 30), "gpt": (4, 50, 10)}
WINDOWS, QUICK_WINDOWS = 10, 5
ALL_REDUCE_CALLS, QUICK_ALL_REDUCE_CALLS = 3000, 300  # each size, after a tenth as many untimed
PROBE_STEPS, QUICK_PROBE_STEPS = 300, 40  # fit alone, its collectives timed, on the first workload
GROUP_TIMEOUT_S = 60  # a collective that waits longer fails the launch instead of hanging it
LAUNCH_TIMEOUT_S, QUICK_LAUNCH_TIMEOUT_S = 900, 120
LOOPS = ("plain", "with_all_reduces", "fit")


# -- the parent: one launch, then the figures ------------------------------------------------
def run(quick: bool, device: str) -> dict[str, Any]:
    asked = harness.device_of(device)
    config = {
        "workloads": QUICK if quick else FULL,
        "all_reduce_calls": QUICK_ALL_REDUCE_CALLS if quick else ALL_REDUCE_CALLS,
        "probe_steps": QUICK_PROBE_STEPS if quick else PROBE_STEPS,
    }
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
    windows = QUICK_WINDOWS if quick else WINDOWS
    return {
        "device": "cpu",
        "asked": asked,
        "world_size": raw["world_size"],
        "backend": raw["backend"],
        "threads": raw["threads"],
        "windows": windows,
        "workloads": {name: figures(w, windows, raw["world_size"]) for name, w in raw["workloads"].items()},
        "probe": raw["probe"],
        "all_reduce": {
            key: {"numel": v["numel"], "dtype": v["dtype"], "us": harness.summary([1e6 * t for t in v["seconds"]])}
            for key, v in raw["all_reduce"].items()
        },
    }


def figures(w: dict[str, Any], windows: int, world: int) -> dict[str, Any]:
    """Per window: each loop's median step; over the windows: their median and range, and the ratio
    of each loop's samples/s to the plain loop's. Over every turn: what each adds to the plain step,
    and what fit adds beyond its all_reduces."""
    out: dict[str, Any] = {k: w[k] for k in ("description", "batch", "warmup")}
    for mode, times in w["modes"].items():
        size = len(times["plain"]) // windows
        cuts = [slice(i * size, (i + 1) * size) for i in range(windows)]
        ms = {loop: [1e3 * statistics.median(times[loop][c]) for c in cuts] for loop in LOOPS}
        out[mode] = {
            "micro_batch": times["micro_batch"],
            "steps": len(times["plain"]),
            "step_ms": {loop: harness.summary(ms[loop]) for loop in LOOPS},
            "samples_per_s": {loop: 1e3 * world * w["batch"] / statistics.median(ms[loop]) for loop in LOOPS},
            "ratio": {
                loop: harness.summary([p / x for p, x in zip(ms["plain"], ms[loop], strict=True)]) for loop in LOOPS
            },
            "added_us": {
                loop: harness.summary([1e6 * (x - p) for p, x in zip(times["plain"], times[loop], strict=True)])
                for loop in LOOPS
            },
            "fit_beyond_all_reduces_us": harness.summary(
                [1e6 * (f - a) for a, f in zip(times["with_all_reduces"], times["fit"], strict=True)]
            ),
        }
    return out


def markdown(r: dict[str, Any]) -> str:
    where = f"{r['world_size']} ranks on the CPU ({r['backend']}, {r['threads']} torch thread each)"
    if r["asked"] != "cpu":
        where += f" ({r['asked']} asked: NCCL is not measured, its two ranks would need a GPU each)"
    lines = [
        f"{where}. Three loops take turns step by step: the plain DDP loop, the same with fit's small "
        "all_reduces where fit makes them (+ar), and `gputui.fit`. Step: median (min-max) over "
        f"{r['windows']} windows of each window's median step. Ratio: samples/s over the plain loop's, median "
        "(min-max) over the windows. Adds: the step minus the plain step of the same turn, median [quartiles] "
        "over the turns. Samples/s are of the global batch (every rank's).",
        "",
        "| workload (batch a rank) | micro-batch | steps | plain step (ms) | +ar step (ms) | fit step (ms) "
        "| samples/s plain / fit | ratio +ar | ratio fit | +ar adds (us) | fit adds (us) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]

    def adds(s: dict[str, Any]) -> str:
        return f"**{harness.fmt(s['median'])}** [{harness.fmt(s['q1'])}, {harness.fmt(s['q3'])}]"

    for w in r["workloads"].values():
        for mode in ("whole", "half"):
            m = w.get(mode)
            if m is None:
                continue
            step, sps, ratio, added = m["step_ms"], m["samples_per_s"], m["ratio"], m["added_us"]
            lines.append(
                f"| {w['description']} | {m['micro_batch'] or 'whole batch'} | {m['steps']} | "
                f"{harness.spread(step['plain'])} | {harness.spread(step['with_all_reduces'])} | "
                f"{harness.spread(step['fit'])} | {harness.fmt(sps['plain'])} / {harness.fmt(sps['fit'])} | "
                f"{harness.spread(ratio['with_all_reduces'])} | **{harness.spread(ratio['fit'])}** | "
                f"{adds(added['with_all_reduces'])} | {adds(added['fit'])} |"
            )
    beyond = "; ".join(
        f"{w['description'].split(' (')[0]} {m['micro_batch'] or 'whole batch'}: "
        f"{adds(m['fit_beyond_all_reduces_us'])} us"
        for w in r["workloads"].values()
        for m in (w.get("whole"), w.get("half"))
        if m is not None
    )
    lines += ["", f"Fit's step minus the +ar step of the same turn (what fit adds beyond its all_reduces): {beyond}."]
    lines += [
        "",
        "Fit's small all_reduces (as the probe below found them) alone, back to back after a barrier (rank 0):",
        "",
        "| all_reduce | calls | us a call (median [quartiles], min-max) |",
        "| --- | --- | --- |",
    ]
    for a in r["all_reduce"].values():
        us = a["us"]
        lines.append(
            f"| {a['numel']} {a['dtype']} | {us['n']} | **{harness.fmt(us['median'])}** "
            f"[{harness.fmt(us['q1'])}, {harness.fmt(us['q3'])}], {harness.fmt(us['min'])}-{harness.fmt(us['max'])} |"
        )
    p = r["probe"]
    per_step = ", ".join(
        f"{c['name']} of {c['numel']} {c['dtype']} x{c['per_step']:.3g} ({harness.fmt(c['us']['median'])} us)"
        for c in p["collectives"]
    )
    lines += [
        "",
        f"The collectives fit adds a step ({p['steps']} steps of {p['workload']} through fit alone, rank 0, each "
        f"call's median): {per_step or 'none'}. The whole exchange took {harness.spread(p['exchange_us'])} us a "
        f"step and agree_valid {harness.spread(p['agree_valid_us'])} us, waiting for the other rank included. "
        "Whether the synced backward failed anywhere rides on DDP's own gradient all-reduce (3 elements appended "
        "to its last bucket by fit's comm hook): not a collective of fit's, so not counted here.",
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
        first = next(iter(config["workloads"]))
        probed = probe(first, config["workloads"][first][0], config["probe_steps"])
        sizes = [c["numel"] for c in probed["collectives"] if c["name"] == "all_reduce"]  # in fit's order
        result: dict[str, Any] = {
            "world_size": dist.get_world_size(),
            "backend": dist.get_backend(),
            "threads": torch.get_num_threads(),
            "probe": probed,
            "workloads": {},
        }
        for name, (batch, steps, warmup) in config["workloads"].items():
            modes = {}
            for mode, micro_batch in (("whole", None), ("half", batch // 2)):
                data, description = interleaved(name, batch, micro_batch, warmup + steps, sizes)
                modes[mode] = {"micro_batch": micro_batch, **data.pairs(warmup)}
            result["workloads"][name] = {"description": description, "batch": batch, "warmup": warmup, "modes": modes}
        calls = config["all_reduce_calls"]
        result["all_reduce"] = {
            str(n): {"numel": n, "dtype": "int64", "seconds": all_reduce_loop(n, calls, calls // 10)} for n in sizes
        }
        if dist.get_rank() == 0:
            from workloads import write

            write(out, result)
    finally:
        gc.collect()  # DDP wrappers before their group (see gputui/engine/strategies/group.py's _destroy)
        dist.destroy_process_group()


class Interleaved:
    """Batches for fit that, before yielding each one, run each of `loops` one step on it (taking
    turns in order): the time between two requests, less those steps, is fit's step. Fit asks for
    the next batch before it trains the current one, so the first interval holds no step."""

    def __init__(self, loops: dict[str, Callable[[Any], None]], batches: list[Any], steps: int) -> None:
        self.loops, self.batches, self.steps = loops, batches, steps
        self.times: dict[str, list[float]] = {name: [] for name in [*loops, "fit"]}

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[Any]:
        last = None
        loops = list(self.loops.items())
        for i in range(self.steps):
            batch = self.batches[i % len(self.batches)]
            start = time.perf_counter()
            for name, step in loops if i % 2 == 0 else loops[::-1]:
                begin = time.perf_counter()
                step(batch)
                self.times[name].append(time.perf_counter() - begin)
            end = time.perf_counter()
            if last is not None:
                self.times["fit"].append(start - last)
            last = end
            yield batch

    def pairs(self, warmup: int) -> dict[str, list[float]]:
        """Each loop's step times after `warmup`, aligned: entry j of each list was taken in one turn."""
        return {name: t[warmup:] if name == "fit" else t[warmup:-1] for name, t in self.times.items()}


def plain_ddp(w: Workload, micro_batch: int | None, all_reduces: Sequence[int] = ()) -> Callable[[Any], None]:
    """What a script with its own DDP loop does a step, on a copy of the workload's model; with a
    micro-batch, the pieces fit cuts, all but the last under no_sync(). `all_reduces`: int64 vectors
    of these sizes made, all-reduced and read back where fit does its own: the first after the last
    forward, the others after the synced backward."""
    import contextlib
    import copy

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from gputui.step.microbatch import batch_size, split

    model = DistributedDataParallel(copy.deepcopy(w.model))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)

    def exchange(size: int) -> None:
        vector = torch.tensor([0] * size, dtype=torch.int64)
        dist.all_reduce(vector)
        vector.tolist()

    def step(batch: Any) -> None:
        total = batch_size(batch)
        pieces = split(batch, micro_batch or total, total)
        for i, piece in enumerate(pieces):
            last = i == len(pieces) - 1
            with contextlib.nullcontext() if last else model.no_sync():
                loss = w.step(model, piece)
                if last and all_reduces:
                    exchange(all_reduces[0])
                (loss * (batch_size(piece) / total) if len(pieces) > 1 else loss).backward()
        for size in all_reduces[1:]:
            exchange(size)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def interleaved(
    name: str, batch: int, micro_batch: int | None, steps: int, all_reduces: list[int]
) -> tuple[Interleaved, str]:
    """One fit run taking turns with the plain loop, with and without fit's all_reduces."""
    from workloads import make

    import gputui

    w = make(name, batch=batch)
    loops = {"plain": plain_ddp(w, micro_batch), "with_all_reduces": plain_ddp(w, micro_batch, all_reduces)}
    data = Interleaved(loops, w.batches, steps)
    gputui.fit(w.model, data, w.step, w.optimizer(), device="cpu", micro_batch=micro_batch)
    return data, w.description


def probe(name: str, batch: int, steps: int) -> dict[str, Any]:
    """A fit run alone with torch.distributed's calls and fit's exchange timed: which collectives fit
    adds a step (DDP's own gradient all-reduce goes through its reducer, not these functions)."""
    import torch.distributed as dist
    from workloads import make

    import gputui
    from gputui.engine.strategies.wrapper import Distributed

    calls: list[tuple[str, int, str, float]] = []
    methods: dict[str, list[float]] = {"exchange": [], "agree_valid": []}

    def timed(fn: Callable[..., Any], note: Callable[[float, Any], None]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                note(time.perf_counter() - start, args)

        return wrapper

    def collective(kind: str) -> Callable[[float, Any], None]:
        def note(t: float, args: Any) -> None:
            # fit's own all_reduces are int64; a float one is DDP's last gradient bucket, which fit's comm
            # hook sends through dist.all_reduce with its verdict appended: DDP's, not fit's, to add.
            if kind == "broadcast" or str(args[0].dtype) == "torch.int64":
                calls.append((kind, args[0].numel(), str(args[0].dtype).split(".")[-1], t))

        return note

    def method(kind: str) -> Callable[[float, Any], None]:
        return lambda t, args: methods[kind].append(t)

    originals = {kind: getattr(dist, kind) for kind in ("all_reduce", "broadcast")}
    own = {kind: getattr(Distributed, kind) for kind in methods}
    for kind, fn in originals.items():
        setattr(dist, kind, timed(fn, collective(kind)))
    for kind, fn in own.items():
        setattr(Distributed, kind, timed(fn, method(kind)))
    try:
        w = make(name, batch=batch)
        done = gputui.fit(w.model, w.batches, w.step, w.optimizer(), device="cpu", max_steps=steps).steps
    finally:
        for kind, fn in originals.items():
            setattr(dist, kind, fn)
        for kind, fn in own.items():
            setattr(Distributed, kind, fn)
    seen: dict[tuple[str, int, str], list[float]] = {}
    for kind, numel, dtype, t in calls:
        seen.setdefault((kind, numel, dtype), []).append(t)
    return {
        "workload": w.description,
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


def all_reduce_loop(numel: int, calls: int, warmup: int) -> list[float]:
    """Seconds of each of `calls` back-to-back all_reduces of an int64 vector of `numel`."""
    import torch
    import torch.distributed as dist

    tensor = torch.zeros(numel, dtype=torch.int64)
    dist.barrier()
    times = []
    for i in range(warmup + calls):
        start = time.perf_counter()
        dist.all_reduce(tensor)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"]:
        worker(sys.argv[2], json.loads(sys.argv[3]))
    else:
        harness.main(run, __doc__)
