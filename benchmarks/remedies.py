"""Memory saved per remedy: the step peak of the small GPT at its start configuration, with the
micro-batch halved once, twice and three times, with AMP bf16 and fp16, with checkpointing, and
all combined.

On the CPU the peak is gputui's tracked bytes (`hub.latest().memory.peak` after a few steps: the
parameters, gradients, optimizer state and saved activations at the step's fullest moment). On
a CUDA device (`--device cuda`, or auto where one is) the same configurations also run on it and
fill the columns for the step's peak allocated and the reserved bytes; without one they say
"not measured", never a number.
"""

from __future__ import annotations

import statistics
import sys
from itertools import pairwise
from typing import Any

import harness

STEPS = 4  # the last step has optimizer state, like every step of a real run
CONFIGS = [
    ("start: micro-batch 32 (the whole batch)", {}),
    ("micro-batch halved once (16 x 2)", {"micro_batch": 16}),
    ("micro-batch halved twice (8 x 4)", {"micro_batch": 8}),
    ("micro-batch halved three times (4 x 8)", {"micro_batch": 4}),
    ("AMP bf16", {"amp": "bf16"}),
    ("AMP fp16 (with a GradScaler)", {"amp": "fp16"}),
    ("activation checkpointing", {"checkpointing": True}),
    ("combined: 4 x 8, bf16, checkpointing", {"micro_batch": 4, "amp": "bf16", "checkpointing": True}),
]


def peak(device: str, options: dict[str, Any]) -> dict[str, Any]:
    """One short fit into a fresh hub: the last step's memory reading and the step time."""
    import gc

    import torch
    from workloads import make

    import gputui
    from gputui.telemetry import hub as hubs

    if device.startswith("cuda"):
        gc.collect()
        torch.cuda.empty_cache()  # each configuration reserves from nothing
    hub = hubs.Hub()
    hubs.install(hub)
    try:
        w = make("gpt", device=device)
        gputui.fit(w.model, w.batches[:STEPS], w.step, w.optimizer(), device=device, **options)
    finally:
        hubs.install(None)
    samples = hub.samples()
    m = samples[-1].memory
    steps = [b.t - a.t for a, b in pairwise(samples[1:])]
    return {
        "peak": m.peak,
        "reserved": m.reserved,
        "allocated": m.allocated,
        "step_ms": 1e3 * statistics.median(steps) if steps else None,
    }


def run(quick: bool, device: str) -> dict[str, Any]:
    device = harness.device_of(device)
    from workloads import make

    rows = []
    for label, options in CONFIGS:
        row = {
            "config": label,
            "options": options,
            "cpu": peak("cpu", options),
            "cuda": peak(device, options) if device.startswith("cuda") else None,
        }
        rows.append(row)
        print(f"remedies {label}: {row['cpu']['peak']} B", file=sys.stderr)
    gpu = None
    if device.startswith("cuda"):
        import torch

        gpu = torch.cuda.get_device_name(device)
    return {"device": device, "gpu": gpu, "description": make("gpt").description, "steps": STEPS, "rows": rows}


def markdown(r: dict[str, Any]) -> str:
    from gputui.units import format_bytes

    base = r["rows"][0]

    def saved(now: int | None, before: int | None) -> str:
        return "" if now is None or not before else f" ({100 * (now - before) / before:+.0f}%)"

    gpu = f"CUDA ({r['gpu']})" if r["gpu"] else "CUDA"
    lines = [
        f"{r['description']}; the figures of step {r['steps']} (optimizer state present). "
        "CPU: gputui's tracked bytes at the step's peak; step time on this CPU for reference "
        "(AMP on a CPU saves memory, not time).",
        "",
        f"| configuration | CPU tracked peak | CPU step (ms) | {gpu} peak allocated | {gpu} reserved |",
        "| --- | --- | --- | --- | --- |",
    ]
    for row in r["rows"]:
        cpu, cuda = row["cpu"], row["cuda"]
        if cuda is None:
            gpu_cells = f"{harness.NOT_MEASURED} | {harness.NOT_MEASURED}"
        else:
            gpu_cells = (
                f"{format_bytes(cuda['peak'])}{saved(cuda['peak'], base['cuda']['peak'])} | "
                f"{format_bytes(cuda['reserved'])}{saved(cuda['reserved'], base['cuda']['reserved'])}"
            )
        lines.append(
            f"| {row['config']} | {format_bytes(cpu['peak'])}{saved(cpu['peak'], base['cpu']['peak'])} | "
            f"{harness.fmt(cpu['step_ms'])} | {gpu_cells} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    harness.main(run, __doc__)
