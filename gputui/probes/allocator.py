"""Which CUDA allocator this process runs, and what its figures cannot show.

`PYTORCH_ALLOC_CONF` (or, read only when that is not set, the older `PYTORCH_CUDA_ALLOC_CONF`)
picks it: `backend:cudaMallocAsync` hands memory to the driver's pool, which keeps no blocks, so
torch's `memory_stats()` leaves fragmentation, retries and OOMs at 0 and recording history or
taking a snapshot raises (c10/cuda/CUDAMallocAsyncAllocator.cpp). Under `expandable_segments:True`
the native allocator counts no inactive split bytes for blocks in expandable segments
(CUDACachingAllocator.cpp), so fragmentation reads 0 whatever the blocks are. A figure that
reads 0 because it is not counted is shown as n/a with the reason, never as "0 B fragmented".
"""

from __future__ import annotations

import os

import torch

NATIVE = "native"
"""PyTorch's caching allocator: the only backend with block statistics, history and snapshots."""

ENV = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF")
"""Where torch reads its allocator settings, in its order: the first that is set, alone."""

NOT_COUNTED = ("fragmented", "alloc_retries", "ooms")
"""The Memory figures only the native allocator's blocks give."""


def parse(text: str) -> dict[str, str]:
    """`key:value,key:[a:b,c:d]` as torch's tokenizer reads it (whitespace ignored) -> {key: value}."""
    text = "".join(text.split())
    entries, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += (char == "[") - (char == "]")
        if char == "," and depth == 0:
            entries.append(text[start:i])
            start = i + 1
    entries.append(text[start:])
    return dict(entry.split(":", 1) for entry in entries if ":" in entry)


def settings() -> dict[str, str]:
    """The settings in force: the environment's, updated by the last string torch parsed (the
    environment at start, or `torch.cuda.memory._set_allocator_settings()` since, which leaves
    the keys it does not name as they were)."""
    env = next((os.environ[name] for name in ENV if name in os.environ), "")
    found = parse(env)
    last = getattr(torch._C, "_accelerator_getAllocatorSettings", None)  # torch 2.9 and later
    if last is not None:
        found.update(parse(last()))
    return found


def backend() -> str:
    """ "native" or "cudaMallocAsync" (or a pluggable allocator's name): torch's answer where it was
    built with CUDA, else the settings' (a CPU-only torch has no CUDA allocator to ask)."""
    try:
        return str(torch.cuda.get_allocator_backend())
    except (AttributeError, RuntimeError):
        return settings().get("backend", NATIVE)


def unreadable() -> dict[str, str]:
    """The Memory figures the allocator in use reads as 0 without counting them, each with why:
    the probe leaves them None, and the screen shows "n/a (why)"."""
    name = backend()
    if name != NATIVE:
        return dict.fromkeys(NOT_COUNTED, name)
    if settings().get("expandable_segments") == "True":
        return {"fragmented": "expandable segments"}
    return {}


def history_unavailable() -> str | None:
    """Why memory history and snapshots cannot be had from this allocator (None: they can)."""
    name = backend()
    if name == NATIVE:
        return None
    return (
        f"memory snapshots and history need PyTorch's native allocator, and this process runs "
        f"backend:{name} (set by PYTORCH_ALLOC_CONF or PYTORCH_CUDA_ALLOC_CONF), which keeps no blocks to show"
    )
