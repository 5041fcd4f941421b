"""Host CPU a call of reading the CUDA caching allocator, run as a child by benchmarks/tool_costs.py
(which never imports torch itself). Prints one JSON line: each call's microseconds a call, per run,
or {"skipped": why} where there is no CUDA device.

    python benchmarks/allocator_reads.py DEVICE CALLS_A_RUN RUNS
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's gputui


def main(device_name: str, calls_a_run: int, runs: int) -> dict[str, Any]:
    if device_name == "cpu" or not torch.cuda.is_available():
        return {"skipped": "--device cpu" if device_name == "cpu" else "no CUDA device"}
    from gputui.probes.cuda import CudaProbe

    device = torch.device("cuda", torch.cuda.current_device())
    kept = [torch.empty(n, device=device) for n in (10, 2**10, 2**20, 2**24)]  # both pools in use
    probe = CudaProbe(device)
    calls = {
        "memory_stats": lambda: torch.cuda.memory_stats(device),
        "memory_allocated": lambda: torch.cuda.memory_allocated(device),
        "memory_stats_as_nested_dict": lambda: torch.cuda.memory_stats_as_nested_dict(device),
        "probe.read": probe.read,
    }
    out: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "keys": len(torch.cuda.memory_stats(device)),
    }
    for name, call in calls.items():
        for _ in range(100):
            call()
        us = []
        for _ in range(runs):
            t0 = time.perf_counter()
            for _ in range(calls_a_run):
                call()
            us.append(1e6 * (time.perf_counter() - t0) / calls_a_run)
        out[name] = us
    del kept
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))))
