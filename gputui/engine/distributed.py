"""fit() under torchrun: the process group, the DDP wrapper and the one exchange per step.

Loaded only when fit runs with WORLD_SIZE > 1 (or is given a model already wrapped in DDP): a
single process never builds any of this, and its step pays one `is None` test.

The rule that keeps a job from hanging: every rank issues the same collectives in the same order.
A step on each rank is: its micro-batches under `no_sync()` but the last, the last one's forward,
then the exchange (one all_reduce of a small int64 vector: the first collective of the step),
then, only if every rank is fine, the synced backward, the running statistics' broadcast and
`optimizer.step()`. Whatever fails on one rank before the exchange (an OOM, any error, data that
ran out) is said there, and every rank acts on it together.
"""

from __future__ import annotations

import atexit
import gc
import inspect
import os
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import psutil
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

from ..telemetry.controls import Control
from ..telemetry.sample import RankMemory
from . import exchange
from .result import FitError

_VERDICT_RANKS = 24  # the synced backward's verdict names the failing ranks below this one (float32 bits)

UNUSED = (
    "some parameters got no gradient in this step, so DDP could not finish its reduction, and fit wrapped "
    "the model without find_unused_parameters: wrap it yourself before fit, "
    "DistributedDataParallel(model, find_unused_parameters=True)"
)
"""Why a model fit wrapped cannot train when a step leaves some parameters out."""


_warned_sampler = False
_group_ours = False  # the default process group is one a fit made (this process's first, or after an abort)

# torch 2.13 renamed broadcast_buffers=False (which also skipped the buffers' sync at init) to
# forward_sync_buffers=False (which keeps it); older versions know only the first.
_NO_FORWARD_SYNC: dict[str, Any] = (
    {"forward_sync_buffers": False}
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
    else {"broadcast_buffers": False}
)


def device_for(device: str | torch.device | None) -> str | torch.device | None:
    """Each rank on its own GPU: cuda:LOCAL_RANK when the device is unnamed or just "cuda"."""
    if torch.cuda.is_available() and (device is None or str(device) == "cuda"):
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return device


def job_id() -> str:
    """What every rank of one torchrun job shares and no other job does: its run id (torchrun makes
    one up when none is given) and where its ranks met."""
    where = f"{os.environ.get('MASTER_ADDR', '')}:{os.environ.get('MASTER_PORT', '')}"
    return f"{os.environ.get('TORCHELASTIC_RUN_ID', 'none')}@{where}"


@dataclass
class Failure:
    """What ended this rank's step: said at the exchange, then raised on every rank."""

    message: str
    oom: bool
    error: BaseException | None = None


@dataclass
class Agreed:
    """What the exchange told every rank (the same on each)."""

    items: int
    """What the step's loss is a mean over, summed over all ranks: the global batch's samples, or the
    items fit(items=) counts in it (tokens). Each rank's gradient is weighted by its share of this."""
    all_have_batch: bool
    all_have_next: bool
    fatal: int
    fatal_oom: int
    fatal_ranks: list[int]
    stop: str | None


class Distributed:
    """This rank's place in the job, and the step's one exchange."""

    def __init__(
        self,
        model: nn.Module,
        device: torch.device,
        data: Any,
        *,
        shard: bool = False,
        blocks: Sequence[nn.Module] = (),
        optimizer: torch.optim.Optimizer | None = None,
    ) -> None:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        global _group_ours
        if not dist.is_initialized():
            backend = "nccl" if device.type == "cuda" else "gloo"
            dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
            if not _group_ours:
                atexit.register(_destroy)  # the script made no group: ours goes when the process does
            _group_ours = True
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self._verdict = _Verdict(self.world_size)  # this rank's verdict on its synced backward, and every rank's
        self.device = device if dist.get_backend() == "nccl" else torch.device("cpu")  # where the vector lives
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
            # Whether the synced backward failed anywhere rides on DDP's own gradient all-reduce (the
            # last bucket's, a few more elements): no collective of its own. A script's DDP may have a
            # hook of its own: there a small all_reduce after the backward says it (agree_valid).
            # The hook's state holds the verdicts alone: DDP's reducer keeps it in C++, where the
            # garbage collector cannot see a cycle, and one back to the wrapper kept it alive after
            # fit with its gradient buckets (a copy of every gradient) for the life of the process.
            self.model.register_comm_hook(self._verdict, _with_verdict)
        if not self.fsdp:
            self.inner: nn.Module = self.model.module
            synced = self.ours or (self._buffer_sync is not None and self._buffer_sync[1])
            self._buffers: list[torch.Tensor] = list(self.model.modules_buffers) if synced else []
        self.sampler = _distributed_sampler(data)
        self._first_epoch = getattr(self.sampler, "epoch", 0)
        if self.sampler is None and isinstance(data, DataLoader):
            _warn_sampler(self.rank)
        self.failure: Failure | None = None
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
                torch.autograd.graph.get_gradient_edge(p).node.register_hook(_arrival(self.arrived, i))
                for i, p in enumerate(self._params)
            ]
            self._hooks.append(self.model.register_forward_hook(self._forwarded))
        self._outgoing: list[Control] = []
        self._agreed: list[Control] = []
        self.ranks: tuple[RankMemory, ...] = ()
        """Every rank's micro-batch, step peak and capacity, as the last exchange told them."""
        self._configured: list[int] = []  # every rank's micro_batch setting at the last exchange (0: whole)
        self._batches: list[int] = []  # every rank's batch at the last exchange
        self._resized: int | None = None  # the job's micro-batch as set at this boundary
        self.thrashing: list[int] = []  # the ranks whose allocator thrashed, as the last exchange said

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

    def abort(self) -> None:
        """After a failure under FSDP that this rank cannot complete its collectives from: a group fit
        made goes now, so the other ranks' collectives fail at once instead of at the timeout."""
        if _group_ours and dist.is_initialized():
            dist.destroy_process_group()

    def _forwarded(self, module: nn.Module, args: Any, output: Any) -> None:
        if torch.is_grad_enabled() and self.model.require_backward_grad_sync:
            self.prepared = [t for t in _tensors(output) if t.requires_grad]

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

    def queue(self, controls: list[Control]) -> None:
        """Controls this rank drained at its boundary: the next exchange tells every rank."""
        self._outgoing.extend(controls)

    def aligned(self) -> tuple[int, int] | None:
        """The smallest micro-batch setting among the ranks (and a rank that has it), where some rank
        set one (an OOM it recovered from alone, a control): every rank runs the same from the next
        boundary, so a step's micro-batches line up and a control acts on the same value everywhere."""
        set_ = [(size, r) for r, size in enumerate(self._configured) if size > 0]
        return min(set_) if set_ else None

    def passes(self, setting: int | None) -> int:
        """Forward/backward passes every rank runs in this step under FSDP (each all-gathers, so the
        count must be the same everywhere): the most any rank's batch needs at `setting` (the micro-batch
        setting, aligned on every rank; None: the whole batch), as the exchange just told."""
        return max((-(-b // min(setting or b, b)) for b in self._batches if b > 0), default=1)

    def job_sizes(self) -> tuple[int, int]:
        """The job's micro-batch and batch at the last exchange: the largest rank's (or what a resize at
        this boundary made it). Halve and double act on these, so every rank decides alike (a rank
        with a short last batch would not), and two halvings at one boundary halve twice."""
        micro = self._resized if self._resized is not None else max(r.micro_batch for r in self.ranks)
        return micro, max(self._batches)

    def resized(self, micro_batch: int) -> None:
        """Every rank set the job's micro-batch at this boundary (the next exchange says it anyway)."""
        self._resized = micro_batch

    def take_agreed(self) -> list[Control]:
        """The controls the last exchange announced, for every rank to apply at this boundary."""
        agreed, self._agreed = self._agreed, []
        return agreed

    def exchange(
        self,
        *,
        items: int | None,
        has_next: bool,
        stop: str | None,
        micro_batch: int | None = None,
        setting: int | None = None,
        batch: int | None = None,
        peak: int | None = None,
        capacity: int | None = None,
        loss: float | None = None,
        samples_per_s: float | None = None,
        ooms: int = 0,
        thrashing: bool = False,
    ) -> Agreed:
        """The step's one collective before the synced backward; `items`: this rank's share of the
        global batch's items (samples, unless fit counts items), None: no batch here. Each rank also
        says its micro-batch (what it runs, and its setting: None for the whole batch) and its last
        step's peak and capacity, in a row of its own (exchange.py declares the vector)."""
        asked: dict[tuple[str, Any], list[Control]] = {}
        for control in self._outgoing:
            asked.setdefault((control.action, control.value), []).append(control)
        self._outgoing = []
        failure = self.failure
        job = {
            "has_batch": items is not None,
            "items": items,
            "has_next": has_next,
            "fatal": failure is not None,
            "fatal_oom": failure is not None and failure.oom,
            "fatal_ranks": 1 << self.rank if failure is not None and self.rank < exchange.MASKED_RANKS else 0,
            **{reason: stop == reason for reason in exchange.STOPS},
        }
        job["requested"] = job["requested"] or bool(asked.pop(("stop", None), None))
        mine = {
            "micro_batch": micro_batch,
            "setting": setting,
            "batch": batch,
            "peak": peak,
            "capacity": capacity,
            "loss": loss,
            "samples_per_s": samples_per_s,
            "ooms": ooms,
            "thrashing": thrashing,
        }
        counts = [len(asked.get(key, ())) for key in exchange.CONTROLS]
        tensor = torch.tensor(
            exchange.encode(job, counts, mine, self.rank, self.world_size), dtype=torch.int64, device=self.device
        )
        _collective(dist.all_reduce, tensor)
        summed = exchange.decode(tensor.tolist(), self.world_size)
        for (action, value), count in zip(exchange.CONTROLS, summed.controls, strict=True):
            local = asked.get((action, value), [])
            others = count - len(local)
            self._agreed.extend(local + [Control(action, value, source="another rank") for _ in range(others)])
        rows = summed.ranks
        self.ranks = tuple(
            RankMemory(
                r,
                row["micro_batch"],
                row["peak"],
                row["capacity"],
                loss=row["loss"],
                samples_per_s=row["samples_per_s"],
                ooms=row["ooms"],
            )
            for r, row in enumerate(rows)
        )
        self.thrashing = [r for r, row in enumerate(rows) if row["thrashing"]]
        self._resized = None
        self._configured = [row["setting"] for row in rows]
        self._batches = [row["batch"] for row in rows]
        totals = summed.job
        return Agreed(
            items=totals["items"],
            all_have_batch=totals["has_batch"] == self.world_size,
            all_have_next=totals["has_next"] == self.world_size,
            fatal=totals["fatal"],
            fatal_oom=totals["fatal_oom"],
            fatal_ranks=[
                r for r in range(min(self.world_size, exchange.MASKED_RANKS)) if totals["fatal_ranks"] >> r & 1
            ],
            stop=next((reason for reason in exchange.STOPS if totals[reason]), None),
        )

    def reached(self, roots: list[torch.Tensor]) -> set[int] | None:
        """The parameters a failed synced step's graph reaches (ids), where DDP needs to know: with
        find_unused_parameters it marks the others itself. None: every parameter."""
        return _reachable(roots) if self.model.find_unused_parameters else None

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

    def begin_synced(self) -> None:
        """Before the synced backward: no gradient taken yet, nothing failed."""
        self.arrived.clear()
        self._verdict.clear()

    def failed_synced(self, fatal: bool) -> bool:
        """This rank's synced step failed, before its buckets are completed: the last one carries it.
        False when the last bucket went out before the failure (the others cannot hear of it now)."""
        bit = 1 << self.rank if self.rank < _VERDICT_RANKS else 0
        self._verdict.mine = [1, int(fatal), bit]
        return not (self.ours and self._verdict.sent)

    def agree_valid(self) -> tuple[int, int, list[int]]:
        """After the synced backward, before anything uses its gradients: (ranks whose backward failed,
        of which cannot go on, the failing ranks). Every rank drops the step's gradients on a failure."""
        if self.ours:
            summed = self._verdict.summed
            if summed is None:  # the bucket of a parameter that got no gradient never went out
                raise FitError(f"rank {self.rank}: {UNUSED}")
            failures, fatals, ranks = (round(x) for x in summed.tolist())
        else:
            tensor = torch.tensor(self._verdict.mine, dtype=torch.int64, device=self.device)
            _collective(dist.all_reduce, tensor)
            failures, fatals, ranks = tensor.tolist()
        return failures, fatals, [r for r in range(min(self.world_size, _VERDICT_RANKS)) if ranks >> r & 1]

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
            _collective(dist.broadcast, flat, 0)
            if self.rank != 0:
                offset = 0
                for b in group:
                    b.detach().copy_(flat[offset : offset + b.numel()].view_as(b))
                    offset += b.numel()


def _collective(op: Any, *args: Any) -> None:
    """One of fit's own collectives; a peer gone (killed, crashed, its node lost) is a FitError that
    says so, not the transport's traceback."""
    try:
        op(*args)
    except torch.OutOfMemoryError:
        raise
    except RuntimeError as exc:  # DistBackendError, DistNetworkError, gloo's and nccl's errors
        raise lost_ranks(exc) from None


def lost_ranks(exc: BaseException) -> FitError:
    """The FitError of a rank whose collective failed because another rank left."""
    message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return FitError(
        f"rank {dist.get_rank()} lost the other ranks (one was killed, crashed or timed out; its output "
        f"says why) [{message}]"
    )


def is_transport(exc: BaseException) -> bool:
    """An error of the collectives' transport (a peer gone, a timeout), not of this rank's step: a
    collective inside FSDP's forward or backward fails so, not through _collective."""
    text = str(exc)
    return type(exc).__name__.startswith("Dist") or any(
        mark in text for mark in ("Connection closed", "Connection reset", "Timed out", "pair.cc", "unbound_buffer")
    )


class _Verdict:
    """This rank's verdict on its synced backward (failed, cannot go on, its bit) and every rank's
    summed, as fit's DDP comm hook carries them; nothing else, so nothing leads back to the wrapper."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.clear()

    def clear(self) -> None:
        self.mine = [0, 0, 0]
        self.sent = False  # the step's last bucket went out, carrying `mine`
        self.summed: torch.Tensor | None = None


def _with_verdict(v, bucket):
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


def _arrival(arrived: set[int], index: int) -> Any:
    def hook(grad_inputs: Any, grad_outputs: Any) -> None:
        arrived.add(index)

    return hook


def _tensors(output: Any) -> list[torch.Tensor]:
    """The tensors in a forward's output (a tensor, or containers of them, as DDP finds them)."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (list, tuple)):
        return [t for item in output for t in _tensors(item)]
    return []


def _reachable(roots: list[torch.Tensor]) -> set[int]:
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


def _distributed_sampler(data: Any) -> DistributedSampler[Any] | None:
    if not isinstance(data, DataLoader):
        return None
    for sampler in (data.sampler, getattr(data.batch_sampler, "sampler", None)):
        if isinstance(sampler, DistributedSampler):
            return sampler
    return None


def _warn_sampler(rank: int) -> None:
    """Once a process, on rank 0: every rank would train on the same batches."""
    global _warned_sampler
    if _warned_sampler or rank != 0:
        return
    _warned_sampler = True
    warnings.warn(
        "gputui.fit under torchrun: data is a DataLoader without a DistributedSampler, so every rank "
        "trains on the same batches; pass DataLoader(..., sampler=DistributedSampler(dataset, "
        "num_replicas=world_size, rank=rank)) (WORLD_SIZE and RANK from the environment)",
        stacklevel=5,
    )


def _destroy() -> None:
    """The group goes before the interpreter does, after the DDP wrappers fit left to the garbage
    collector: one torn down at interpreter exit with its group gone aborted the process
    (SIGABRT, "terminate called without an active exception") in about 1 launch in 10. Then the
    group's gloo workers finish what they hold (_let_workers_finish), even where the group went
    earlier (abort) or lives on in what still holds it (a sharded model, torch's DTensor caches)."""
    if dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()
    _let_workers_finish()


def _let_workers_finish(limit_s: float = 5.0) -> None:
    """Wait, the GIL released, until the gloo worker threads of this process are done (at most
    `limit_s`). A worker drops a finished collective after its caller has moved on, and dropping it
    takes the GIL (its tensors and the thread-local state it captured are Python objects): once the
    interpreter is finalizing, taking the GIL ends the thread (pthread_exit) inside a C++ destructor,
    which aborts the process (SIGABRT, "terminate called without an active exception"). A rank that
    leaves right after its last collective (an OOM under FSDP, then exit) on a busy machine got there
    before its starved worker did in about 1 launch in 7.

    Done: no worker runnable twice in a row, each look after 10 ms without the GIL (a worker waiting
    for it gets it then, or is still runnable). Torch names the threads pt_gloo_runloop; where psutil
    cannot read a thread as a process (not Linux), there is nothing to wait for."""
    deadline = time.monotonic() + limit_s
    quiet = 0
    while quiet < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
        quiet = 0 if _gloo_running() else quiet + 1


def _gloo_running() -> bool:
    """Whether a gloo worker thread of this process is runnable now (psutil reads Linux's threads as processes)."""
    for thread in psutil.Process().threads():
        try:
            task = psutil.Process(thread.id)
            if task.name() == "pt_gloo_runloop" and task.status() == psutil.STATUS_RUNNING:
                return True
        except psutil.Error:  # ended meanwhile, or not a process here
            continue
    return False
