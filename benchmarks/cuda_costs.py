"""What reading the CUDA allocator and NVML costs, and what recording the allocator's history costs:
the calls gputui makes after steps (the probe's read, a few times a second; memory_stats(), which it
avoids; the deferred loss's event, every step) and beside them (NVML on its poller thread, a snapshot
at an OOM). What they add to a step in place: benchmarks/fit_cost.py.

    python benchmarks/cuda_costs.py --device cuda --json OUT

Each figure is the median of many calls, in microseconds, after a warm-up; the allocator holds a
few hundred live blocks meanwhile, as during a step. Without a CUDA device it says so and measures
nothing (benchmarks/gpu_check.py runs it on the device).
"""

from __future__ import annotations

import os
import pickle
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import harness

CALLS = {"full": 2000, "quick": 200}
HISTORY_ALLOCS = 10_000  # allocations recorded before the dump (their stacks alike: symbolized once)


def per_call(fn: Callable[[], Any], calls: int) -> dict[str, Any]:
    """Microseconds a call: median, quartiles and range over batches of 10 calls."""
    for _ in range(max(10, calls // 10)):
        fn()
    times = []
    for _ in range(calls // 10):
        t0 = time.perf_counter()
        for _ in range(10):
            fn()
        times.append(1e5 * (time.perf_counter() - t0))  # per call, in us
    return harness.summary(times)


def allocator(device: Any, calls: int) -> dict[str, Any]:
    import torch

    from gputui.probes.cuda import CudaProbe

    out: dict[str, Any] = {
        "memory_stats_keys": len(torch.cuda.memory_stats(device)),
        "memory_stats": per_call(lambda: torch.cuda.memory_stats(device), calls),
        "memory_stats_as_nested_dict": per_call(lambda: torch.cuda.memory_stats_as_nested_dict(device), calls),
        "memory_allocated": per_call(lambda: torch.cuda.memory_allocated(device), calls),
        "memory_reserved": per_call(lambda: torch.cuda.memory_reserved(device), calls),
        "reset_peak_memory_stats": per_call(lambda: torch.cuda.reset_peak_memory_stats(device), calls),
        "mem_get_info": per_call(lambda: torch.cuda.mem_get_info(device), calls // 4),
    }
    try:
        probe = CudaProbe(device)
        out["probe_read"] = per_call(probe.read, calls)
    except Exception as exc:  # the probe's signature is the engine's to change: the rest still counts
        out["probe_read"] = {"n": 0, "error": f"{type(exc).__name__}: {exc}"}
    from gputui.engine.deferred import DeferredLoss

    losses, loss = DeferredLoss.for_device(device), torch.ones((), device=device)
    out["deferred_loss_put"] = per_call(lambda: losses.put(loss), calls)
    return out


def nvml(calls: int) -> dict[str, Any]:
    try:
        import pynvml

        from gputui.probes.nvml import read_gpus

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    try:
        return {
            "memory_info": per_call(lambda: pynvml.nvmlDeviceGetMemoryInfo(handle), calls // 4),
            "compute_processes": per_call(lambda: pynvml.nvmlDeviceGetComputeRunningProcesses(handle), calls // 4),
            "read_gpus": per_call(read_gpus, max(20, calls // 40)),
        }
    finally:
        pynvml.nvmlShutdown()


def history(device: Any, stacks: str) -> dict[str, Any]:
    """Allocation cost with the history recorded (`stacks`: "python" or "all", C++ frames too) and
    without, then the dump of HISTORY_ALLOCS allocations: its time, size and entries."""
    import torch

    def churn() -> None:
        x = torch.empty(1 << 20, dtype=torch.uint8, device=device)
        del x

    off = per_call(churn, 2000)
    torch.cuda.memory._record_memory_history(max_entries=100_000, stacks=stacks)
    try:
        on = per_call(churn, 2000)
        for _ in range(HISTORY_ALLOCS):
            churn()
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "snapshot.pickle")
            t0 = time.perf_counter()
            torch.cuda.memory._dump_snapshot(path)
            dump_s = time.perf_counter() - t0
            size = os.path.getsize(path)
            with open(path, "rb") as f:
                snapshot = pickle.load(f)
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    entries = sum(len(trace) for trace in snapshot.get("device_traces", []))
    return {
        "stacks": stacks,
        "alloc_free_us": {"off": off, "on": on},
        "dump_s": dump_s,
        "pickle_bytes": size,
        "entries": entries,
        "bytes_per_entry": size / entries if entries else None,
    }


def run(quick: bool, device: str) -> dict[str, Any]:
    device = harness.device_of(device)
    if not device.startswith("cuda"):
        return {"device": device, "skipped": harness.NOT_MEASURED}
    import torch

    dev = torch.device(device)
    torch.cuda.init()
    calls = CALLS["quick" if quick else "full"]
    live = [torch.empty(n << 10, device=dev) for n in range(1, 300)]  # blocks the stats walk over
    out: dict[str, Any] = {"device": device, "gpu": torch.cuda.get_device_name(dev), "calls": calls}
    out["allocator"] = allocator(dev, calls)
    print(f"cuda costs: memory_stats {out['allocator']['memory_stats']['median']:.1f} us", file=sys.stderr)
    out["nvml"] = nvml(calls)
    del live
    out["history"] = []
    for stacks in ("python", "all"):
        try:
            out["history"].append(history(dev, stacks))
        except Exception as exc:
            out["history"].append({"stacks": stacks, "error": f"{type(exc).__name__}: {exc}"})
    return out


def markdown(r: dict[str, Any]) -> str:
    if "skipped" in r:
        return f"CUDA API costs: {r['skipped']}.\n"
    rows = [(f"`{k}`", v) for k, v in r["allocator"].items() if isinstance(v, dict)]
    rows += [(f"NVML `{k}`", v) for k, v in r["nvml"].items() if isinstance(v, dict)]
    lines = [
        f"{r['gpu']}; memory_stats() flattens {r['allocator']['memory_stats_keys']} keys.",
        "",
        "| call | us: median (min-max) |",
        "| --- | --- |",
        *(f"| {name} | {harness.spread(s) if s.get('n') else s.get('error', 'n/a')} |" for name, s in rows),
        "",
        "| history stacks | alloc+free off / on (us) | dump of the history | pickle | entries |",
        "| --- | --- | --- | --- | --- |",
    ]
    for h in r["history"]:
        if "error" in h:
            lines.append(f"| {h['stacks']} | {h['error']} | | | |")
            continue
        a = h["alloc_free_us"]
        lines.append(
            f"| {h['stacks']} | {harness.fmt(a['off']['median'])} / {harness.fmt(a['on']['median'])} | "
            f"{h['dump_s']:.2f} s | {h['pickle_bytes'] / 2**20:.1f} MiB | {h['entries']:,} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    harness.main(run, __doc__)
