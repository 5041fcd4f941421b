"""Top tensors: what is holding the memory, found the way the OOM guides do it, by walking gc.

Groups the live, Python-visible tensors by shape, dtype, device and role (parameter, gradient,
optimizer state, other), largest first. Storage shared by views counts once. The walk stops at
a time budget so a heap of millions of objects cannot freeze training: the report says so.
"""

from __future__ import annotations

import gc
import time
import warnings
from typing import Any, Iterable

import torch

from .cpu import storage_key


def top_tensors(*, limit: int = 20, time_budget: float = 0.5, params: Iterable[torch.Tensor] = (),
                grads: Iterable[torch.Tensor] = (), optimizer_state: Iterable[torch.Tensor] = ()) -> dict[str, Any]:
    start = time.monotonic()
    roles = {id(t): "optimizer state" for t in optimizer_state}
    roles.update({id(t): "gradient" for t in grads})
    roles.update({id(t): "parameter" for t in params})
    with warnings.catch_warnings():  # isinstance() on deprecated module proxies warns
        warnings.simplefilter("ignore")
        return _scan(limit, start, start + time_budget, roles)


def _scan(limit: int, start: float, deadline: float, roles: dict[int, str]) -> dict[str, Any]:
    objects = gc.get_objects()
    groups: dict[tuple[Any, ...], list[int]] = {}
    storages: set[int] = set()
    scanned = tensors = 0
    complete = True
    for scanned, obj in enumerate(objects, 1):
        if scanned % 4096 == 0 and time.monotonic() > deadline:
            complete = False
            break
        try:
            if not isinstance(obj, torch.Tensor):
                continue
            ptr, size = storage_key(obj)
            key = (tuple(obj.shape), str(obj.dtype).removeprefix("torch."), str(obj.device),
                   roles.get(id(obj), "other"))
        except Exception:  # noqa: BLE001 - lazy proxies, fake tensors: not ours to judge
            continue
        tensors += 1
        group = groups.setdefault(key, [0, 0])
        group[0] += 1
        if ptr not in storages:
            storages.add(ptr)
            group[1] += size
    del objects
    rows = sorted(groups.items(), key=lambda kv: kv[1][1], reverse=True)
    return {
        "rows": [{"shape": list(k[0]), "dtype": k[1], "device": k[2], "role": k[3], "count": c, "bytes": b}
                 for k, (c, b) in rows[:limit]],
        "groups": len(rows),
        "tensors": tensors,
        "total_bytes": sum(b for _, (_, b) in rows),
        "scanned": scanned,
        "complete": complete,
        "elapsed_s": round(time.monotonic() - start, 4),
    }
