"""The synced backward's verdict under fit's own DDP on gloo, with no collective of its own.

Every collective costs a step the time the ranks take to meet (on a loaded CPU, a millisecond), so
most steps exchange nothing: a rank with something to say (its backward failed, a control or a stop
asked of it, its data ending, its micro-batch or batch changed, the rows due) writes NaN into the
first element of DDP's last gradient bucket before it goes out. The all-reduce carries the NaN to
every rank, so each knows at the same point, from what it holds, whether the step needs an exchange
(ddp.py); the element's true value travels in that exchange and is put back. The last bucket is
waited for here, in slices (waiting.py), so a rank that stops answering is said and a stop is heard.
Also here: what a rank needs to rescue the others from its failure (which parameters' gradients DDP
took already, which ones the failed graph reaches)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

MASKED_RANKS = 62  # a slot naming ranks (the exchange's, a script's DDP's verdict) names those below (int64 bits)


def rank_bit(rank: int, flag: object) -> int:
    """This rank's share of a slot naming ranks (one bit each, below MASKED_RANKS) where `flag` holds."""
    return 1 << rank if flag and rank < MASKED_RANKS else 0


def ranks_in(bits: int, world_size: int) -> list[int]:
    """The ranks a summed slot of rank_bit()s names."""
    return [r for r in range(min(world_size, MASKED_RANKS)) if bits >> r & 1]


class Marker:
    """This rank's side of the marker, as fit's DDP comm hook uses it; nothing else, so nothing leads
    back to the wrapper (DDP's reducer keeps the hook's state in C++, where the garbage collector
    cannot see a cycle: one back to the wrapper would keep its gradient buckets alive)."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.wait: Callable[[Any], None] = Marker.wait_alone  # the rank's Waiter, once it has one
        self.clear()

    @staticmethod
    def wait_alone(work: Any) -> None:
        work.wait()

    def clear(self) -> None:
        self.mean = True  # the buckets divided by the world size (DDP's mean); else summed (a quiet step)
        self.news = False  # this rank marks the step's last bucket
        self.sent = False  # the step's last bucket went out
        self.heard = False  # some rank marked it: the step exchanges after its synced backward
        self.value = 0.0  # this rank's share of the marked element, as it went out
        self.param: torch.Tensor | None = None  # the parameter whose gradient holds the element
        self.error: BaseException | None = None  # what ended the wait for the bucket (a stop, a timeout)


def _reduced(done: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
    return done.value()[0]


def with_marker(m, bucket):
    """DDP's all-reduce of a bucket, in place as its default hook: the mean over the ranks, or on a
    quiet step the sum (its losses were weighted for the global batch, so no pass divides them); the
    step's last bucket marked when this rank has news, and waited for in slices. Unannotated: DDP
    compares the annotations with its own types, and here they would be strings."""
    buffer = bucket.buffer()
    if m.mean:
        buffer.div_(m.world_size)
    if not bucket.is_last():
        return dist.all_reduce(buffer, async_op=True).get_future().then(_reduced)
    m.sent = True
    m.param = bucket.parameters()[0]  # the buffer starts with this parameter's gradient
    m.value = buffer[0].item()  # a CPU tensor: no device to wait for
    if m.news:
        buffer[0] = math.nan
    work = dist.all_reduce(buffer, async_op=True)
    try:
        m.wait(work)
    except BaseException as exc:  # raised inside DDP's reducer, it comes out of backward() as its own error
        m.error = exc
        raise
    m.heard = math.isnan(buffer[0].item())
    done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    done.set_result(buffer)
    return done


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
