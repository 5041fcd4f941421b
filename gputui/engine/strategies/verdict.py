"""The synced backward's verdict under DDP: whether any rank's failed, carried on DDP's own last
gradient bucket (no collective of its own), and what a rank needs to rescue the others from its
failure (which parameters' gradients DDP took already, which ones the failed graph reaches)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

VERDICT_RANKS = 24  # the verdict names the failing ranks below this one (float32 bits in a bucket)


class Verdict:
    """This rank's verdict on its synced backward (failed, cannot go on, its bit) and every rank's
    summed, as fit's DDP comm hook carries them; nothing else, so nothing leads back to the wrapper."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.clear()

    def clear(self) -> None:
        self.mine = [0, 0, 0]
        self.sent = False  # the step's last bucket went out, carrying `mine`
        self.summed: torch.Tensor | None = None


def with_verdict(v, bucket):
    """DDP's all-reduce of a bucket (the mean over the ranks, as its default hook), with each rank's
    verdict on its synced backward appended to the last bucket of the step and summed with it.
    Unannotated: DDP compares the annotations with its own types, and here they would be strings."""
    if not bucket.is_last():
        return default_hooks.allreduce_hook(None, bucket)  # type: ignore[arg-type]
    buffer = bucket.buffer()
    v.sent = True
    verdict = torch.tensor(v.mine, dtype=buffer.dtype, device=buffer.device)
    joined = torch.cat([buffer / v.world_size, verdict])
    size = buffer.numel()

    def split(done: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        out = done.value()[0]
        v.summed = out[size:]
        return out[:size]

    return dist.all_reduce(joined, async_op=True).get_future().then(split)


def arrival(arrived: set[int], index: int) -> Any:
    def hook(grad_inputs: Any, grad_outputs: Any) -> None:
        arrived.add(index)

    return hook


def tensors(output: Any) -> list[torch.Tensor]:
    """The tensors in a forward's output (a tensor, or containers of them, as DDP finds them)."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (list, tuple)):
        return [t for item in output for t in tensors(item)]
    return []


def reachable(roots: list[torch.Tensor]) -> set[int]:
    """The ids of the leaves the roots' graph accumulates into (its edges outlive a failed backward)."""
    found: set[int] = set()
    seen: set[Any] = set()
    stack = [root.grad_fn for root in roots]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None:
            found.add(id(variable))
        stack.extend(next_node for next_node, _ in node.next_functions)
    return found
