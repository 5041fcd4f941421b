"""The workloads the benchmarks train, mostly taken from the demos so they are the models users see:
the tiny MLP of demos/mlp.py (a step of a few milliseconds on a CPU) and the small GPT of
demos/gpt.py (tens of milliseconds); zoo.py's models are shaped unlike them. Batches are made
before timing and cycled, so data loading is never measured.

Run as a script, it is one timed training process of the overhead benchmark: the same model
and batches through a plain PyTorch loop (`--loop plain`) or through `gputui.fit` (`--loop fit`,
also what `gputui run` runs), or both taking turns in blocks (`--loop alternating`) or step by step (`--loop interleaved`), reporting
its own timings to `--out`:

    python benchmarks/workloads.py --model mlp --loop fit --steps 500 --warmup 50 --out r.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import torch

from gputui.step.microbatch import to_device

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "demos"))
import gpt as demo_gpt
import mlp as demo_mlp
import zoo


@dataclass
class Workload:
    name: str
    description: str
    model: torch.nn.Module
    batches: list[Any]
    step: Callable[[torch.nn.Module, Any], torch.Tensor]
    batch_size: int

    def optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.model.parameters(), lr=3e-3)


def make(name: str, *, device: str = "cpu", seed: int = 0, batch: int | None = None, distinct: int = 16) -> Workload:
    """A fresh model (same weights for the same seed) and `distinct` batches, both on `device`."""
    w = _make(name, seed, batch, distinct)
    w.model.to(device)
    w.batches = [to_device(b, torch.device(device)) for b in w.batches]
    return w


def _make(name: str, seed: int, batch: int | None, distinct: int) -> Workload:
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed + 1)
    if name == "mlp":
        width, depth = demo_mlp.SIZES["tiny"]
        batch = batch or 256
        model = demo_mlp.MLP(64, width, depth, 10)
        batches = [
            (torch.randn(batch, 64, generator=g), torch.randint(10, (batch,), generator=g)) for _ in range(distinct)
        ]
        what = f"demos/mlp.py tiny (width {width}, depth {depth}), batch {batch}, AdamW"
        return Workload(name, what, model, batches, demo_mlp.step, batch)
    if name == "gpt":
        width, layers, heads, seq = demo_gpt.SIZES["small"]
        batch = batch or 32
        model = demo_gpt.GPT(256, width, layers, heads, seq)
        batches = list(demo_gpt.MarkovTokens(256, seq, batch, distinct, seed))
        what = f"demos/gpt.py small (width {width}, {layers} layers, seq {seq}), batch {batch}, AdamW"
        return Workload(name, what, model, batches, demo_gpt.step, batch)
    if name == "null":  # a step that costs torch little: what a loop adds to it stands out of the noise
        batch = batch or 4
        model = torch.nn.Sequential(torch.nn.Linear(1, 1), torch.nn.ReLU(), torch.nn.Linear(1, 1))
        batches = [(torch.randn(batch, 1, generator=g), torch.randn(batch, 1, generator=g)) for _ in range(distinct)]
        what = f"two 1x1 linear layers, batch {batch}, AdamW: a step that is mostly torch's own Python"
        return Workload(name, what, model, batches, _mse, batch)
    if name in zoo.MAKERS:
        model, batches, step, batch, what = zoo.MAKERS[name](g, batch, distinct)
        return Workload(name, what, model, batches, step, batch)
    raise ValueError(f"unknown workload {name!r}")


def _mse(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(batch[0]), batch[1])


class Timed:
    """`steps` batches (cycled), noting when each is asked for: the time between two requests is one
    whole step of whichever loop iterates, its bookkeeping included."""

    def __init__(self, batches: list[Any], steps: int, warmup: int = 0) -> None:
        self.batches, self.steps, self.warmup, self.times = batches, steps, warmup, []
        self.cpu_start: dict[str, float] = {}

    def __len__(self) -> int:
        return self.steps

    def __iter__(self):
        for i in range(self.steps):
            if i == self.warmup:
                self.cpu_start = thread_cpu()
            self.times.append(time.perf_counter())
            yield self.batches[i % len(self.batches)]


def thread_cpu() -> dict[str, float]:
    """CPU seconds so far of this process's threads, by role: the training thread (the caller), the
    main thread when it is another one (`gputui run`'s, waiting for its screen), gputui's other Python
    threads, the rest (torch's native worker threads); and the screen's process (`gputui run`'s child)."""
    import threading

    import psutil

    me, main = threading.get_native_id(), threading.main_thread().native_id
    python = {t.native_id for t in threading.enumerate()}
    out = {"training": 0.0, "ui": 0.0, "gputui threads": 0.0, "torch threads": 0.0, "screen": 0.0}
    for child in psutil.Process().children(recursive=True):
        try:
            times = child.cpu_times()
        except psutil.Error:
            continue
        out["screen"] += times.user + times.system
    for t in psutil.Process().threads():
        role = (
            "training"
            if t.id == me
            else "ui"
            if t.id == main
            else "gputui threads"
            if t.id in python
            else "torch threads"
        )
        out[role] += t.user_time + t.system_time
    return out


def plain_loop(w: Workload, data: Timed) -> None:
    """The reference: what a hand-written loop does per step, nothing more."""
    model, optimizer = w.model, w.optimizer()
    model.train()
    for batch in data:
        loss = w.step(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def fit_loop(w: Workload, data: Timed) -> None:
    import gputui

    gputui.fit(w.model, data, w.step, w.optimizer(), device=next(w.model.parameters()).device)


def alternating(w: Workload, blocks: int, size: int, warmup: int) -> dict[str, list[float]]:
    """Blocks of `size` steps through each loop, taking turns in this one process: a slow spell of
    the machine lasts seconds, a pair of blocks a fraction of one. Per block: seconds per step
    after `warmup` steps (a new optimizer's first step, fit's first counted steps), up to the request
    of the last batch (not fit's return: a block is not charged its end of run)."""
    out: dict[str, list[float]] = {"plain": [], "fit": []}
    for block in range(blocks):
        for loop in ("plain", "fit") if block % 2 == 0 else ("fit", "plain"):
            data = Timed(w.batches, size)
            (plain_loop if loop == "plain" else fit_loop)(w, data)
            out[loop].append((data.times[-1] - data.times[warmup]) / (size - 1 - warmup))
    return out


class Interleaved:
    """Batches for fit that, before yielding each one, train a copy of the model one plain step on
    it: the two loops alternate step by step in one process, so every slow spell of the machine
    falls on both, and the difference of a pair is what fit adds to a step."""

    def __init__(self, w: Workload, steps: int) -> None:
        import copy

        self.w, self.steps = w, steps
        self.model = copy.deepcopy(w.model)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=3e-3)
        self.plain: list[float] = []
        self.fit: list[float] = []

    def __len__(self) -> int:
        return self.steps

    def __iter__(self):
        batches, last = self.w.batches, None
        for i in range(self.steps):
            batch = batches[i % len(batches)]
            start = _end(self.w)
            loss = self.w.step(self.model, batch)
            loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            end = _end(self.w)
            self.plain.append(end - start)
            if last is not None:
                self.fit.append(start - last)  # fit's step on the previous batch, its bookkeeping included
            last = end
            yield batch


def _end(w: Workload) -> float:
    """Now, once the device has done what was queued (the plain loop never waits for a GPU itself)."""
    if next(w.model.parameters()).is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=["mlp", "gpt", "null", *zoo.MAKERS], required=True)
    p.add_argument("--loop", choices=["plain", "fit", "alternating", "interleaved"], required=True)
    p.add_argument("--steps", type=int, required=True, help="timed steps (after the warm-up); alternating: per block")
    p.add_argument("--warmup", type=int, required=True, help="steps run first and not timed")
    p.add_argument("--blocks", type=int, default=20, help="alternating: blocks of each loop")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, help="torch's intra-op threads (default: torch's, one a core)")
    p.add_argument("--batch", type=int, help="samples a step (default: the workload's)")
    p.add_argument("--out", required=True, help="where to write the JSON result")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    w = make(args.model, device=args.device, batch=args.batch)
    if args.loop == "interleaved":
        data = Interleaved(w, args.warmup + args.steps)
        fit_loop(w, data)
        write(args.out, {"plain": data.plain[args.warmup : -1], "fit": data.fit[args.warmup :]})
        return
    if args.loop == "alternating":
        write(args.out, alternating(w, args.blocks, args.warmup + args.steps, args.warmup))
        return
    data = Timed(w.batches, args.warmup + args.steps, args.warmup)
    (plain_loop if args.loop == "plain" else fit_loop)(w, data)
    end = _end(w)
    cpu = thread_cpu()
    times = data.times[args.warmup :] + [end]
    steps = sorted(b - a for a, b in pairwise(times))
    median = 1e3 * steps[len(steps) // 2] if args.device == "cpu" else None  # a GPU's steps end out of sight
    result = {
        "samples_per_s": args.steps * w.batch_size / (end - times[0]),
        "step_ms_median": median,
        "steps": args.steps,
        "warmup": args.warmup,
        "threads": torch.get_num_threads(),
        "cpu_pct": {k: 100 * (cpu[k] - data.cpu_start.get(k, 0.0)) / (end - times[0]) for k in cpu},
    }
    write(args.out, result)


def write(path: str, result: Any) -> None:
    """Whole or not at all: the parent takes the file's appearance as the end of the run."""
    with open(path + ".part", "w") as f:
        json.dump(result, f)
    os.replace(path + ".part", path)


if __name__ == "__main__":
    main()
