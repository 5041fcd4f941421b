"""The bytes a device's allocator counts for a storage: on CUDA, the caching allocator's block, which is what
`memory_allocated()` and `max_memory_allocated()` add up, not the bytes asked for.

The rules are c10/cuda/CUDACachingAllocator.cpp's (its constants are c10/core/AllocatorConfig.h's): a
request is rounded up to 512 B (`round_size`); one of at most 1 MiB comes from the small pool, whose 2 MiB
segments are split at any 512 B, so its block is the rounded size; a larger one comes from a segment of
20 MiB (under 10 MiB) or of the size rounded up to 2 MiB (`get_allocation_size`), and the segment is split
only if more than 1 MiB would remain (`should_split`): an 11.5 MiB tensor holds a 12 MiB block. With
`expandable_segments:True` every block is split at 512 B; with `max_split_size_mb` set, a request of at
least that size is never split. The block counted is the one a new segment gives: one cut from a larger
cached block can only be larger, and what a run measures corrects the rest (predictions.py).
`roundup_power2_divisions` is not modelled (off by default).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import private

MIN_BLOCK = 512  # kMinBlockSize
SMALL_SIZE = 1 << 20  # kSmallSize: the largest request of the small pool
LARGE_BUFFER = 20 << 20  # kLargeBuffer: the segment a request under MIN_LARGE_ALLOC is cut from
MIN_LARGE_ALLOC = 10 << 20  # kMinLargeAlloc
ROUND_LARGE = 2 << 20  # kRoundLarge: a larger request's segment is rounded up to this


@dataclass(frozen=True)
class CudaBlocks:
    """The CUDA caching allocator's block for a request of `nbytes`, under its settings."""

    expandable: bool = False
    max_split: int | None = None  # max_split_size_mb, in bytes

    def __call__(self, nbytes: int) -> int:
        if nbytes <= 0:  # an empty storage allocates nothing
            return 0
        size = -(-nbytes // MIN_BLOCK) * MIN_BLOCK
        if size <= SMALL_SIZE or self.expandable:
            return size
        segment = LARGE_BUFFER if size < MIN_LARGE_ALLOC else -(-size // ROUND_LARGE) * ROUND_LARGE
        splits = (self.max_split is None or size < self.max_split) and segment - size > SMALL_SIZE
        return size if splits else segment


def exact(nbytes: int) -> int:
    """A device without a caching allocator (the CPU): the bytes asked for."""
    return nbytes


def rounding(device: torch.device) -> Callable[[int], int]:
    """How the allocator of `device` counts a storage of n bytes."""
    if device.type != "cuda":
        return exact
    settings = private.allocator_settings()
    split = re.search(r"max_split_size_mb:\s*(\d+)", settings)
    return CudaBlocks(
        expandable=re.search(r"expandable_segments:\s*True", settings) is not None,
        max_split=int(split.group(1)) << 20 if split else None,
    )
