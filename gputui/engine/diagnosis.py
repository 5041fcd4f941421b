"""An OOM that ends a script with its own loop: where in the script's code it struck, and the remedies
that would fit the phase it struck in (what `gputui run` prints, and the TUI shows, instead of a
bare traceback)."""

from __future__ import annotations

import os
import traceback

import torch

from ..telemetry.sample import Memory
from ..units import format_bytes


def user_frame(exc: BaseException) -> str:
    """The innermost frame of the script's own code (not torch's, not gputui's)."""
    torch_dir = os.path.dirname(torch.__file__)
    ours = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    frames = [
        f
        for f in traceback.extract_tb(exc.__traceback__)
        if not f.filename.startswith((torch_dir, ours)) and not f.filename.startswith("<frozen")
    ]
    if not frames:
        return "unknown"
    f = frames[-1]
    return f"{os.path.basename(f.filename)}:{f.lineno} in {f.name}" + (f": {f.line.strip()}" if f.line else "")


def fragmentation(memory: Memory | None) -> str | None:
    """What an OOM's error adds when freed blocks inside partly used segments (CUDA's inactive splits) are
    a fifth of what the allocator reserves: there fragmentation ran out, not the step (seen on an H200
    under a cap: 121 MiB of holes beside 141 MiB allocated, and no 16 MiB block). None otherwise."""
    if memory is None or not memory.fragmented or not memory.reserved or memory.fragmented < memory.reserved / 5:
        return None
    return (
        f"{format_bytes(memory.fragmented)} of the {format_bytes(memory.reserved)} reserved is free but split "
        "between live blocks (fragmentation): PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, set before the "
        "process starts, lets the allocator grow its segments in place instead"
    )


def remedies(phase: str, memory: Memory | None) -> list[str]:
    fit = (
        "gputui.fit would have caught this OOM and replayed the batch with half the micro-batch (README: Adopting fit)"
    )
    if phase == "optimizer":
        return [
            "the optimizer's state does not shrink with the batch: a lighter optimizer (SGD with momentum, "
            "Adafactor, 8-bit Adam) or fewer trainable parameters",
            "more memory: --gpu-memory-limit / the budget is lower than the model needs",
        ]
    advice = [
        "a smaller batch, with gradient accumulation to keep the effective batch (fit does it live: b)",
        "activation checkpointing on the repeated blocks (fit: c)",
        "mixed precision: torch.autocast with bf16 (fit: a)",
    ]
    split = fragmentation(memory)
    if split:
        advice.append(split)
    if phase == "backward":
        advice.insert(0, "backward needs the activations saved in forward: checkpointing trades them for compute")
    return [*advice, fit]
