"""Other models: what `gputui.fit` adds to the step of models shaped unlike the demos (benchmarks/zoo.py):
BatchNorm buffers, a Hugging Face-shaped encoder fed dict batches with padding and dropout, a hundred
layers (202 parameter tensors), an LSTM. Each is measured in one process, as overhead.py measures the
demos there: a plain step and a fit step taking turns step by step, and whole fit() calls taking turns with
a plain loop in blocks.

    python benchmarks/models.py --json out.json [--quick] [--device cuda]
"""

from __future__ import annotations

import sys
from typing import Any

import harness
import overhead

# name: (interleaved steps, warm-up; blocks, steps a block, warm-up steps a block), full and quick
SIZES = {
    "cnn": ((300, 20, 30, 16, 4), (30, 5, 3, 8, 2)),
    "encoder": ((300, 20, 30, 16, 4), (30, 5, 3, 8, 2)),
    "deep": ((300, 20, 30, 16, 4), (30, 5, 3, 8, 2)),
    "lstm": ((1000, 50, 40, 24, 4), (60, 10, 3, 12, 3)),
}


def run(quick: bool, device: str) -> dict[str, Any]:
    device = harness.device_of(device)
    out: dict[str, Any] = {"device": device, "models": {}}
    with harness.scratch() as tmp:
        for name, sizes in SIZES.items():
            steps, warmup, blocks, size, block_warmup = sizes[quick]
            print(f"models {name}", file=sys.stderr, flush=True)
            out["models"][name] = {
                "interleaved": overhead.interleaved(tmp, name, steps, warmup, device),
                "blocks": overhead.alternating(tmp, name, blocks, size, block_warmup, device),
            }
    from workloads import make  # the descriptions (torch, only now)

    for name, result in out["models"].items():
        w = make(name)
        result["description"] = w.description
        result["parameter_tensors"] = sum(1 for _ in w.model.parameters())
    return out


def markdown(r: dict[str, Any]) -> str:
    lines = [
        f"Device {r['device']}, torch on one thread. Step by step: fit's step against the plain step before it, "
        "over the pairs said; in blocks: fit and a plain loop taking turns, each fit block a whole fit() call (its "
        "start and threads charged to it), the ratio of each block's steps after its warm-up to its pair's.",
        "",
        "| model | plain step (ms) | fit adds a step (us, median of pairs, quartiles) | ratio, step by step | "
        "ratio, whole fit() blocks (median of pairs) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for m in r["models"].values():
        i, b = m["interleaved"], m["blocks"]
        added = i["added_us"]
        lines.append(
            f"| {m['description']} ({m['parameter_tensors']} parameter tensors) | "
            f"{harness.fmt(i['plain_ms']['median'])} | {harness.fmt(added['median'])} "
            f"({harness.fmt(added['q1'])} to {harness.fmt(added['q3'])}) | {i['ratio']:.3f} ({i['steps']} pairs) | "
            f"{b['paired_ratio']['median']:.3f} ({b['blocks']} pairs of {b['steps'] - b['warmup']} steps) |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    harness.main(run, __doc__)
