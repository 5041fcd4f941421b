"""Top tensors: what is holding the memory, found the way the OOM guides do it, by walking gc.

Groups the live, Python-visible tensors by shape, dtype, device and role (parameter, gradient,
optimizer state, gputui replay: what gputui keeps to replay a step, other), largest first. Storage
shared by views counts once. The tensors the training loop knows (parameters, gradients, optimizer
state) are always counted; the walk for the others stops at a time budget so a heap of millions of
objects cannot stall training, and the report then says it is partial. Where the model is known
(fit), a group of training state names its parameters, indices folded (`blocks.*.mlp.fc1.weight`);
an own loop's optimizer holds the parameters but not their names, so its groups go unnamed.
"""

from __future__ import annotations

import gc
import re
import sys
import time
import warnings
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from .cpu import state_tensors, storage_key

_CHUNK = 20_000
"""Objects checked between two looks at the clock."""

NAMES = 3
"""Name patterns a group lists (then "+N more"): the event stays a few KB however large the model."""

_INDEX = re.compile(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.)")


def top_tensors(
    *,
    limit: int = 20,
    time_budget: float = 0.5,
    params: Iterable[torch.Tensor] = (),
    grads: Iterable[torch.Tensor] = (),
    optimizer_state: Iterable[torch.Tensor] = (),
    replay: Iterable[torch.Tensor] = (),
    names: Mapping[int, str] | None = None,
) -> dict[str, Any]:
    """`replay`: what gputui keeps to replay a step (the generators' states, running statistics'
    copies), its own memory, not the script's; `names`: id(tensor) -> the name a group of training
    state lists (folded_names())."""
    start = time.monotonic()
    groups: dict[tuple[Any, ...], list[int]] = {}
    named: dict[tuple[Any, ...], Counter[str]] = {}
    storages: set[int] = set()
    known: set[int] = set()

    def count(t: torch.Tensor, role: str) -> None:
        try:
            ptr, size = storage_key(t)
            key = (tuple(t.shape), str(t.dtype).removeprefix("torch."), str(t.device), role)
        except Exception:
            return
        group = groups.setdefault(key, [0, 0])
        group[0] += 1
        if ptr not in storages:
            storages.add(ptr)
            group[1] += size
        name = names.get(id(t)) if names else None
        if name is not None:
            named.setdefault(key, Counter())[name] += 1

    roles = (
        ("parameter", params),
        ("gradient", grads),
        ("optimizer state", optimizer_state),
        ("gputui replay", replay),
    )
    for role, tensors in roles:
        for t in tensors:
            if id(t) not in known:
                known.add(id(t))
                count(t, role)
    others, scanned, complete = _walk(start + time_budget)
    for t in others:
        if id(t) not in known:
            count(t, "other")
    rows = sorted(groups.items(), key=lambda kv: kv[1][1], reverse=True)
    return {
        "rows": [
            {"shape": list(k[0]), "dtype": k[1], "device": k[2], "role": k[3], "count": c, "bytes": b}
            | ({"names": _listed(named[k])} if k in named else {})
            for k, (c, b) in rows[:limit]
        ],
        "groups": len(rows),
        "tensors": sum(c for _, (c, _) in rows),
        "total_bytes": sum(b for _, (_, b) in rows),
        "scanned": scanned,
        "complete": complete,
        "elapsed_s": round(time.monotonic() - start, 4),
    }


def top_training_tensors(
    params: list[torch.Tensor],
    optimizer: torch.optim.Optimizer | None,
    model: torch.nn.Module | list[torch.Tensor] | None = None,
    replay: Iterable[torch.Tensor] = (),
) -> dict[str, Any]:
    """top_tensors() with the training state in its roles: the parameters, their gradients, the
    optimizer's state, what gputui keeps to replay a step; named after the parameters when `model` is
    a module (fit's; an own loop's session tracks a list of tensors, which names nothing)."""
    return top_tensors(
        params=params,
        grads=[p.grad for p in params if p.grad is not None],
        optimizer_state=state_tensors(optimizer) if optimizer is not None else [],
        replay=replay,
        names=folded_names(model, optimizer) if isinstance(model, torch.nn.Module) else None,
    )


def folded_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[int, str]:
    """id(tensor) -> its parameter's name with the indices of repeated modules folded into `*`
    (`blocks.3.mlp.0.weight` -> `blocks.*.mlp.*.weight`), for each parameter, its gradient and the
    tensors of its optimizer state; a compiled model's `_orig_mod.` prefix dropped."""
    names: dict[int, str] = {}
    by_param: dict[int, str] = {}
    for name, p in model.named_parameters():
        folded = _INDEX.sub("*", name.removeprefix("_orig_mod."))
        by_param[id(p)] = names[id(p)] = folded
        if p.grad is not None:
            names[id(p.grad)] = folded
    for param, state in optimizer.state.items() if optimizer is not None else ():
        owner = by_param.get(id(param))
        if owner is not None and isinstance(state, dict):
            names.update((id(t), owner) for t in state.values() if isinstance(t, torch.Tensor))
    return names


def _listed(counts: Counter[str]) -> list[str]:
    """The most common name patterns of a group, then "+N more" for the rest."""
    names = [name for name, _ in counts.most_common(NAMES)]
    return names + [f"+{len(counts) - NAMES} more"] if len(counts) > NAMES else names


def _walk(deadline: float) -> tuple[list[torch.Tensor], int, bool]:
    """The tensors among gc's objects, checked in chunks until `deadline`."""
    objects = gc.get_objects()
    found: list[torch.Tensor] = []
    # A planner's trace leaves fake tensors (no memory, no data) for gc to collect: not what holds memory.
    fakes = sys.modules.get("torch._subclasses.fake_tensor")
    fake: type = fakes.FakeTensor if fakes is not None else _NoFake
    with warnings.catch_warnings():  # isinstance() on deprecated module proxies warns
        warnings.simplefilter("ignore")
        for begin in range(0, len(objects), _CHUNK):
            if time.monotonic() > deadline:
                return found, begin, False
            chunk = objects[begin : begin + _CHUNK]
            try:
                found += [o for o in chunk if isinstance(o, torch.Tensor) and not isinstance(o, fake)]
            except Exception:
                found += [o for o in chunk if _is_tensor(o) and not isinstance(o, fake)]
    return found, len(objects), True


class _NoFake:
    """Stands for FakeTensor where torch's fake tensors were never loaded."""


def _is_tensor(obj: object) -> bool:
    try:
        return isinstance(obj, torch.Tensor)
    except Exception:
        return False
