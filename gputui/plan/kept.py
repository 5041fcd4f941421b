"""The tensors of a trace the script kept, found and taken out once the trace is gone.

Each tensor a trace made is watched weakly: one still alive after it was kept somewhere (an lru_cache,
a module-level dict, a list the step appends to). It is looked for in the caches the script's saved
namespaces hold (no heap walk), then, after a garbage collection (a cycle may hold it), among its
referrers, and taken out: an lru_cache is cleared, a dict's entry deleted, items appended to a list or
added to a set removed. Anywhere else (an attribute of an object outside those namespaces, a library's
global, a list's middle) its previous value is unknown: Unsafe, naming where.
"""

from __future__ import annotations

import functools
import gc
import types
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

from . import private
from .prediction import Unsafe

_CACHES = (dict, list, set, private.LruCache)
_TUPLE_DEPTH = 4
"""Tuples a kept tensor is looked for through (a cache of (mask, positions) pairs)."""


def take_out_kept(made: list[weakref.ref[torch.Tensor]], held: Callable[[], list[Any]]) -> None:
    """Each tensor of `made` still alive taken out of what holds it, or Unsafe. `held`: what the script's
    saved namespaces hold now. Most traces leave nothing: the check is a look at the weak references."""
    kept = _alive(made)
    if not kept:
        return
    ids = {id(t) for t in kept}  # stable while `kept` holds them
    for holder in _caches(held()):
        _take_out_of(holder, functools.partial(_holds, ids))
    del kept
    if not _alive(made):
        return
    gc.collect()
    kept = _alive(made)
    if not kept:
        return
    places = _take_out(kept)
    del kept
    gc.collect()
    if _alive(made):
        where = ", ".join(dict.fromkeys(places)) or "somewhere gputui cannot reach"
        raise Unsafe(f"the step kept a tensor of the planner's trace in {where}: it cannot be taken back")


def _alive(made: list[weakref.ref[torch.Tensor]]) -> list[torch.Tensor]:
    return [t for ref in made if (t := ref()) is not None]


def _caches(values: Iterable[Any], depth: int = 2, largest: int = 100_000) -> list[Any]:
    """The containers among `values` and inside them (a dict of dicts of masks): where scripts keep
    what they made, looked through without walking the heap."""
    found: dict[int, Any] = {}
    level = list(values)
    for _ in range(depth):
        level = [v for v in level if isinstance(v, _CACHES) and id(v) not in found]
        found |= {id(v): v for v in level}
        level = [x for c in level if not isinstance(c, private.LruCache) and len(c) <= largest
                 for x in (c.values() if isinstance(c, dict) else c)]  # fmt: skip
    return list(found.values())


def _take_out(kept: list[torch.Tensor]) -> list[str]:
    """Take the kept tensors out of whatever holds them (the referrers, through tuples); where they could
    not be taken out, said in words."""
    internal = _reachable_from(kept)
    internal |= {id(kept)} | {id(vars(t)) for t in kept if hasattr(t, "__dict__")}
    made = {id(t) for t in kept}  # and the tuples holding them

    def has(v: Any) -> bool:
        return id(v) in made

    places = []
    children: list[Any] = kept
    for _ in range(_TUPLE_DEPTH):
        internal.add(id(children))
        holders = gc.get_referrers(*children)
        internal.add(id(holders))
        tuples = []
        for holder in holders:
            if id(holder) in internal or isinstance(holder, (types.FrameType, torch.Tensor)):
                continue
            if isinstance(holder, tuple):
                tuples.append(holder)  # whatever holds the tuple holds the tensor
                made.add(id(holder))
                continue
            place = _take_out_of(holder, has, _owner)
            if place is not None:
                places.append(place)
        if not tuples:
            break
        children = tuples
    return places


_OUTSIDE = (torch.Tensor, types.ModuleType, type, types.FunctionType, types.MethodType)
"""Where the walk of the mode's objects stops: its tensors are the ones looked for, and a function's
globals lead to everything."""


def _reachable_from(kept: list[torch.Tensor], limit: int = 100_000) -> set[int]:
    """The fake tensor mode's own objects, which hold its tensors (memos): not the script's."""
    todo = list({id(m): m for t in kept if (m := private.fake_mode_of(t)) is not None}.values())
    seen = {id(o) for o in todo}
    while todo and len(seen) < limit:
        for o in gc.get_referents(todo.pop()):
            if id(o) not in seen and not isinstance(o, _OUTSIDE):
                seen.add(id(o))
                todo.append(o)
    return seen


def _holds(ids: set[int], v: Any) -> bool:
    """`v` is a kept tensor, or a tuple of them (a cache of (mask, positions) pairs)."""
    return id(v) in ids or (isinstance(v, tuple) and any(id(x) in ids for x in v))


def _take_out_of(holder: Any, has: Callable[[Any], bool], owner_of: Callable[[Any], Any] | None = None) -> str | None:
    """Take what `has` out of `holder`; None when it could (or it held none), else where it is, in words.
    `owner_of`: what a dict is the namespace of (a heap walk; None: a value of a namespace, a plain dict)."""
    if isinstance(holder, private.LruCache):
        # the results, or (unbounded) the dict of them: clearing a cache changes no result
        if any(has(r) or (isinstance(r, dict) and any(map(has, r.values()))) for r in gc.get_referents(holder)):
            holder.cache_clear()
        return None
    if isinstance(holder, dict):
        names = [k for k, v in holder.items() if has(v) or has(k)]
        if not names:
            return None
        owner = owner_of(holder) if owner_of is not None else None
        if isinstance(owner, private.LruCache):  # an unbounded lru_cache's own dict
            owner.cache_clear()
            return None
        if owner is not None:
            return _attribute(owner, names)
        for name in names:
            del holder[name]
        return None
    if isinstance(holder, list):
        first = next((i for i, v in enumerate(holder) if has(v)), len(holder))
        if all(map(has, holder[first:])):  # appended by the trace: the list as it was
            del holder[first:]
            return None
        return "an item of a list"
    if isinstance(holder, set):
        holder.difference_update([v for v in holder if has(v)])
        return None
    if isinstance(holder, types.CellType):
        return "a closure variable"
    names = [k for k, v in getattr(holder, "__dict__", {}).items() if has(v)]
    return _attribute(holder, names) if names else f"a {type(holder).__name__}"


def _owner(d: dict[Any, Any]) -> Any:
    """What `d` is the namespace of (a module, a class, an object), or the lru_cache it is the cache of."""
    for r in gc.get_referrers(d):
        if isinstance(r, private.LruCache) or getattr(r, "__dict__", None) is d:
            return r
        if isinstance(r, type) and vars(r) == d:
            return r
    return None


def _attribute(owner: Any, names: list[Any]) -> str:
    name = ", ".join(map(str, names)) or "?"
    if isinstance(owner, types.ModuleType):
        return f"global {name} of module {owner.__name__}"
    if isinstance(owner, type):
        return f"attribute {name} of class {owner.__name__}"
    return f"attribute {name} of a {type(owner).__name__} object"
