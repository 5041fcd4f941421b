"""fit's process group: joined (or made, and then destroyed at exit), its collectives, and what a
rank says when another left. Loaded only under torchrun (WORLD_SIZE > 1) or for a model in DDP."""

from __future__ import annotations

import atexit
import ctypes
import gc
import os
import time
import warnings
from datetime import timedelta
from typing import Any

import psutil
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from ..result import FitError, first_line

_warned_sampler = False
_group_ours = False  # the default process group is one a fit made (this process's first, or after an abort)
_stuck = False  # a collective was given up on: the group cannot be destroyed (it would wait for it)
_side: tuple[Any, Any] | None = None  # (the default group, the gloo group made beside it)


def join(device: torch.device, timeout_s: float) -> None:
    """This rank in the default process group: the script's (with its own timeout), or one fit makes
    (nccl on a GPU, gloo on a CPU) whose collectives give up after `timeout_s`, destroyed when the
    process ends."""
    global _group_ours
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = timedelta(seconds=timeout_s)
        dist.init_process_group(backend, device_id=device if device.type == "cuda" else None, timeout=timeout)
        if not _group_ours:
            atexit.register(_destroy)  # the script made no group: ours goes when the process does
        _group_ours = True


def exchange_group(timeout_s: float) -> Any:
    """The group fit's exchange travels on: the default one under gloo; under nccl the gloo side group,
    so the exchange is a CPU collective (no device copy, a wait that can be sliced)."""
    return None if dist.get_backend() == "gloo" else side_group(timeout_s)


def side_group(timeout_s: float) -> Any:
    """A gloo group beside the default one, made once a default group (every rank makes it at the same
    point: new_group is a collective): under nccl the exchange's; always the closing exchange's, so under
    gloo it never meets DDP's all-reduce of a rank that went on (a loop longer on one rank; under nccl it
    meets that rank's exchange, whose `closing` slots say it)."""
    global _side
    from torch.distributed.distributed_c10d import _get_default_group

    default = _get_default_group()
    if _side is None or _side[0] is not default:
        _side = (default, dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s)))
    return _side[1]


def store() -> Any:
    """The job's key-value store (torchrun's agent serves it): what the ranks can read of each other
    while their collectives wait."""
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def abandon(work: Any | None) -> None:
    """A collective this rank gives up on: its group and the collective are kept alive (leaked) until
    the process ends, for destroying either waits for the collective to finish or time out, and so
    would a process ending with them; and the group fit made is not destroyed at exit."""
    global _stuck
    from torch.distributed.distributed_c10d import _get_default_group

    _stuck = True
    for kept in (work, _get_default_group(), *(_side[1:] if _side is not None else ())):
        if kept is None:  # no collective of fit's own (DDP's reducer holds the one given up on)
            continue
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(kept))


def abort() -> None:
    """After a failure under FSDP that this rank cannot complete its collectives from: a group fit
    made goes now, so the other ranks' collectives fail at once instead of at the timeout."""
    if _group_ours and dist.is_initialized():
        dist.destroy_process_group()


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


def collective(op: Any, *args: Any) -> None:
    """One of fit's own collectives; a peer gone (killed, crashed, its node lost) is a FitError that
    says so, not the transport's traceback."""
    try:
        op(*args)
    except torch.OutOfMemoryError:
        raise
    except RuntimeError as exc:  # DistBackendError, DistNetworkError, gloo's and nccl's errors
        raise lost_ranks(exc) from None


def lost_ranks(exc: BaseException, where: str = "") -> FitError:
    """The FitError of a rank whose collective failed because another rank left (`where`: " in ...")."""
    message = first_line(exc)
    rank = dist.get_rank()
    who = f"rank {1 - rank}" if dist.get_world_size() == 2 else "one"  # of two, the other one
    why = f"{who} was killed, crashed or timed out; its output says why"
    return FitError(f"rank {rank} lost the other ranks{where} ({why}) [{message}]")


def is_transport(exc: BaseException) -> bool:
    """An error of the collectives' transport (a peer gone, a timeout), not of this rank's step: a
    collective inside FSDP's forward or backward fails so, not through _collective."""
    text = str(exc)
    return type(exc).__name__.startswith("Dist") or any(
        mark in text
        for mark in ("Connection closed", "Connection reset", "Timed out", "pair.cc", "unbound_buffer", "pair closure")
    )


def distributed_sampler(data: Any) -> DistributedSampler[Any] | None:
    if not isinstance(data, DataLoader):
        return None
    for sampler in (data.sampler, getattr(data.batch_sampler, "sampler", None)):
        if isinstance(sampler, DistributedSampler):
            return sampler
    return None


def warn_sampler(rank: int) -> None:
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
    if _stuck:  # a collective given up on: destroying the group would wait for it
        return
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
