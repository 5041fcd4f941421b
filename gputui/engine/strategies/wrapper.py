"""This rank's model under torchrun: wrapped in DDP (or sharded with FSDP2, or the script's own
wrapper used as is), the hooks that let a rank rescue the others from its failed synced backward,
and rank 0's buffers sent to every rank once a step."""

from __future__ import annotations

import inspect
import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from .group import collective, distributed_sampler, exchange_group, job_id, join, side_group, warn_sampler
from .verdict import Marker, arrival, rank_bit, ranks_in, reachable, tensors, with_marker

UNUSED = (
    "some parameters got no gradient in this step, so DDP could not finish its reduction, and fit wrapped "
    "the model without find_unused_parameters: wrap it yourself before fit, "
    "DistributedDataParallel(model, find_unused_parameters=True)"
)
"""Why a model fit wrapped cannot train when a step leaves some parameters out."""

# torch 2.13 renamed broadcast_buffers=False (which also skipped the buffers' sync at init) to
# forward_sync_buffers=False (which keeps it); older versions know only the first.
_NO_FORWARD_SYNC: dict[str, Any] = (
    {"forward_sync_buffers": False}
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
    else {"broadcast_buffers": False}
)


class Distributed:
    """This rank's model in the job: its wrapper, its place (rank, world size) and its sampler."""

    def __init__(
        self,
        model: nn.Module,
        device: torch.device,
        data: Any,
        *,
        shard: bool = False,
        blocks: Sequence[nn.Module] = (),
        optimizer: torch.optim.Optimizer | None = None,
        rank_timeout: float,
    ) -> None:
        join(device, rank_timeout)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.rank_timeout = rank_timeout  # how long a rank waits for the others before it gives up
        self.exchange_group = exchange_group(rank_timeout)
        self.closing_group = side_group(rank_timeout)
        self.marker: Marker | None = None  # the verdict on DDP's last bucket (else: a CPU all_reduce of its own)
        self._failed = (0, 0)  # this rank's verdict on its synced backward: failed, cannot go on
        self._buffer_sync: tuple[str, bool] | None = None
        self.model: Any
        self.fsdp = shard or isinstance(model, FSDPModule)
        if self.fsdp:
            self._init_fsdp(model, shard and not isinstance(model, FSDPModule), blocks, optimizer)
        elif isinstance(model, DistributedDataParallel):
            self.model = model
            self.ours = False
            # Its forward would broadcast rank 0's buffers after each synced forward, a collective a
            # rank replaying alone would issue once more: off while fit runs, done once a step instead.
            attr = "forward_sync_buffers" if hasattr(model, "forward_sync_buffers") else "broadcast_buffers"
            self._buffer_sync = (attr, bool(getattr(model, attr)))
            setattr(model, attr, False)
        else:
            # No buffer sync in forward: DDP would broadcast rank 0's buffers in every forward (a
            # collective a replay could not match); the running statistics are broadcast once a step.
            device_ids = [device.index] if device.type == "cuda" else None
            self.model = DistributedDataParallel(model, device_ids=device_ids, **_NO_FORWARD_SYNC)
            self.ours = True
            # Whether the synced backward failed anywhere, or any rank has news, rides on DDP's own
            # gradient all-reduce (verdict.py): no collective of its own. A script's DDP may have a hook
            # of its own: there a small all_reduce after the backward says it (agree_valid). Under NCCL,
            # or gloo with the model on a GPU, the verdict goes on the CPU beside the exchange: read from
            # a GPU bucket, it would make every step wait for the device.
            if self.exchange_group is None and device.type == "cpu":
                self.marker = Marker(self.world_size)
                self.model.register_comm_hook(self.marker, with_marker)
        if not self.fsdp:
            self.inner: nn.Module = self.model.module
            synced = self.ours or (self._buffer_sync is not None and self._buffer_sync[1])
            self._buffers: list[torch.Tensor] = list(self.model.modules_buffers) if synced else []
        self.sampler = distributed_sampler(data)
        self._first_epoch = getattr(self.sampler, "epoch", 0)
        if self.sampler is None and isinstance(data, DataLoader):
            warn_sampler(self.rank)
        # Which parameters' gradients DDP has taken in the synced backward: a post hook on each one's
        # AccumulateGrad node, registered after DDP's (hooks run in order), so an OOM there can be rescued.
        self._params = [p for p in self.inner.parameters() if p.requires_grad]
        self.arrived: set[int] = set()
        self._hooks: list[Any] = []
        # A synced forward that returned has DDP expecting its backward (prepare_for_backward): an OOM
        # after it (in the loss) is no longer this rank's alone. Its outputs say which parameters.
        self.prepared: list[torch.Tensor] | None = None
        if not self.fsdp:
            self._hooks = [
                torch.autograd.graph.get_gradient_edge(p).node.register_hook(arrival(self.arrived, i))
                for i, p in enumerate(self._params)
            ]
            self._hooks.append(self.model.register_forward_hook(self._forwarded))

    def _init_fsdp(
        self, model: nn.Module, shard: bool, blocks: Sequence[nn.Module], optimizer: torch.optim.Optimizer | None
    ) -> None:
        """FSDP2: a model the script sharded (fully_shard) is used as is; `shard`: fit shards each of
        the repeated blocks checkpointing finds, then the root (the model stays sharded after fit), and
        points the optimizer at the sharded parameters (fully_shard replaces them). Buffers are not
        sharded and FSDP does not sync them: rank 0's go to every rank once a step."""
        if shard:
            if optimizer is not None and optimizer.state:
                raise ValueError(
                    'distributed="fsdp": the optimizer already has state, which would not follow the parameters '
                    "into their shards; shard the model yourself (fully_shard) before making the optimizer"
                )
            names = {id(p): name for name, p in model.named_parameters()}
            for block in blocks:
                fully_shard(block)
            fully_shard(model)
            sharded = dict(model.named_parameters())
            for group in optimizer.param_groups if optimizer is not None else ():
                group["params"] = [sharded[names[id(p)]] for p in group["params"]]
        self.model = self.inner = model
        self.ours = shard
        self._buffers = list(model.buffers())

    @property
    def model_name(self) -> str:
        """The model's class as the script named it (FSDP2 swaps in a subclass named FSDP<name>)."""
        name = type(self.inner).__name__
        return name.removeprefix("FSDP") if self.fsdp else name

    def gradient_sync(self, on: bool) -> None:
        """FSDP2's no_sync: off, a backward accumulates unsharded gradients without reduce-scattering."""
        self.model.set_requires_gradient_sync(on)

    def _forwarded(self, module: nn.Module, args: Any, output: Any) -> None:
        if torch.is_grad_enabled() and self.model.require_backward_grad_sync:
            self.prepared = [t for t in tensors(output) if t.requires_grad]

    def identity(self) -> dict[str, Any]:
        """This rank in its job, for the run's info (`gputui jobs` groups the ranks by `job`)."""
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
            "node": int(os.environ.get("GROUP_RANK", "0")),
            "job": job_id(),
        }

    def set_epoch(self, epoch: int) -> None:
        """A DistributedSampler shuffles by its epoch: fit runs the epochs, so fit sets it."""
        if self.sampler is not None:
            self.sampler.set_epoch(self._first_epoch + epoch)

    def reached(self, roots: list[torch.Tensor]) -> set[int] | None:
        """The parameters a failed synced step's graph reaches (ids), where DDP needs to know: with
        find_unused_parameters it marks the others itself. None: every parameter."""
        return reachable(roots) if self.model.find_unused_parameters else None

    def complete_buckets(self, expected: set[int] | None) -> None:
        """After a synced backward failed here (or the loss after a synced forward): a backward of zeros
        into every parameter whose gradient DDP had not taken yet (of `expected`, see reached()), so
        each bucket the other ranks wait for is all-reduced and DDP finishes its reduction (the next
        forward's check passes)."""
        missing = [
            p for i, p in enumerate(self._params) if i not in self.arrived and (expected is None or id(p) in expected)
        ]
        if missing:
            torch.autograd.backward(missing, grad_tensors=[torch.zeros_like(p) for p in missing])

    @property
    def can_rescue(self) -> bool:
        """Whether a rank that failed before its synced backward can still complete DDP's buckets (a
        reducer that finds unused parameters would look for them in a graph there is none of)."""
        return not self.fsdp and not self.model.find_unused_parameters

    def expect_backward(self) -> None:
        """DDP's reducer awaits this rank's synced backward, as after its synced forward (which a
        rank failed before may not have reached), so complete_buckets() reduces every bucket."""
        self.model.reducer.prepare_for_backward([])

    def begin_synced(self, news: bool = False, mean: bool = True) -> None:
        """Before the synced backward: no gradient taken yet, nothing failed; `news`: this rank marks
        its last bucket (it has something to say after the backward); not `mean`: the buckets are
        summed (a quiet step, weighted for the global batch; fit's comm hook only)."""
        self.arrived.clear()
        self._failed = (0, 0)
        if self.marker is not None:
            self.marker.clear()
            self.marker.news, self.marker.mean = news, mean

    @property
    def params(self) -> list[nn.Parameter]:
        """The parameters DDP reduces the gradients of."""
        return self._params

    @property
    def failed(self) -> tuple[int, int]:
        """This rank's verdict on its synced backward: (failed, cannot go on)."""
        return self._failed

    def failed_synced(self, fatal: bool) -> bool:
        """This rank's synced step failed, before its buckets are completed: the last one carries it.
        False when the last bucket went out before the failure (the others cannot hear of it now)."""
        self._failed = (1, int(fatal))
        if self.marker is None:
            return True
        self.marker.news = True
        return not self.marker.sent

    def bucket_error(self) -> BaseException | None:
        """What ended this rank's wait for its last bucket (a stop, the others gone), raised out of
        DDP's reducer as an error of its own."""
        return self.marker.error if self.marker is not None else None

    def put_back(self, value: float | None) -> None:
        """The marked gradient element's reduced value, from the exchange after the synced backward. The
        bucket holds each gradient in its parameter's layout (DDP's bucket views take its strides), so
        the marked element is the one first in memory: at index (0, ..., 0) in any layout, where a view
        of the gradient as one row would fail for one that is not contiguous (channels_last)."""
        m = self.marker
        if m is not None and m.param is not None and m.param.grad is not None and value is not None:
            grad = m.param.grad
            grad[(0,) * grad.dim()] = value

    def agree_valid(self) -> tuple[int, int, list[int]]:
        """After the synced backward, without the marker (a script's DDP, NCCL): (ranks whose backward
        failed, of which cannot go on, the failing ranks), by a CPU all_reduce of the verdicts. Every
        rank drops the step's gradients on a failure."""
        failed, fatal = self._failed
        bit = rank_bit(self.rank, failed)
        tensor = torch.tensor([failed, fatal, bit], dtype=torch.int64)  # on the CPU: no wait for the device
        collective(dist.all_reduce, tensor, dist.ReduceOp.SUM, self.exchange_group)
        failures, fatals, ranks = tensor.tolist()
        return failures, fatals, ranks_in(ranks, self.world_size)

    def rebuild_buckets(self) -> None:
        """DDP rebuilds its buckets (rank 0 broadcasts their order) in the first forward after the first
        synced backward: a rank failing before it calls its model then would leave the others in that
        broadcast. Done here, after the synced backward, where every rank is; once."""
        if not self.model._has_rebuilt_buckets and self.model.reducer._rebuild_buckets():
            self.model._has_rebuilt_buckets = True

    def close(self) -> None:
        """Remove the hooks and give a script's DDP its buffer sync back: the model outlives fit."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if self.marker is not None:  # the reducer keeps the hook's state: nothing of the run stays reachable
            self.marker.wait = Marker.wait_alone
            self.marker.param = None
        if self._buffer_sync is not None:
            setattr(self.model, *self._buffer_sync)

    def broadcast_buffers(self) -> None:
        """Rank 0's buffers (running statistics, counters) to every rank, once a step, what DDP's
        buffer sync does in every forward: one broadcast per dtype, the buffers flattened into it."""
        groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for buffer in self._buffers:
            groups.setdefault((buffer.dtype, buffer.device), []).append(buffer)
        for group in groups.values():
            flat = torch.cat([b.detach().reshape(-1) for b in group])
            collective(dist.broadcast, flat, 0)
            if self.rank != 0:
                offset = 0
                for b in group:
                    b.detach().copy_(flat[offset : offset + b.numel()].view_as(b))
                    offset += b.numel()
