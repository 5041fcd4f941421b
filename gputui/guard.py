"""What a trace may leave in the script's own objects, put back: names rebound, generators drawn, fakes kept.

plan.predict() runs the script's step() on a fake copy of the model, but the step's own code runs for
real: it may rebind a global or a closure variable (a call counter, a lazily made mask), draw from a
generator of its own, or keep a tensor it made in a cache (an lru_cache, a module-level dict). The next
real step would find a fake tensor there and die ("Please convert all Tensors to FakeTensors first"),
and a plan would change what the run draws. So, around a trace:

- the script's namespaces (the globals of its own modules, the step's and those it imports; its
  classes'; the step's closure; the attributes of the objects they hold) are saved and put back;
- the generators among them (random.Random, NumPy's Generator and RandomState, torch.Generator) too
  (the model's own are copied with it; the process-wide ones are plan._Restored's);
- every tensor the trace made is watched weakly: one still alive once the trace is gone was kept
  somewhere. It is looked for in the caches those namespaces hold (no heap walk), then, after a
  garbage collection (a cycle may hold it), among its referrers, and taken out: an lru_cache is
  cleared, a dict's entry deleted, items appended to a list or added to a set removed. Anywhere
  else (an attribute of an object outside those namespaces, a library's global, a list's middle)
  its previous value is unknown: Unsafe, naming where.

What a trace writes to a file or a socket, or prints, cannot be taken back (README, "The planner").
"""

from __future__ import annotations

import functools
import gc
import os
import random
import sys
import sysconfig
import traceback
import types
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

_MISSING = object()
_FUNCTIONS = 64
"""Functions and objects followed from the step (its closures, defaults, partials): a bound on the walk."""
_CACHES = (dict, list, set, functools._lru_cache_wrapper)
_TUPLE_DEPTH = 4
"""Tuples a kept tensor is looked for through (a cache of (mask, positions) pairs)."""


class Unsafe(Exception):
    """The trace left a tensor in the script's objects where it cannot be taken out; the message says where."""


class Guard:
    """Saves what the script's `step` and `model` could change before a trace; `watch` each tensor the trace
    makes. On exit, once the trace is gone: everything put back, kept tensors taken out, or Unsafe."""

    def __init__(self, step: Callable[..., Any], model: nn.Module) -> None:
        functions, objects = _unwrapped(step)
        self.carried = objects  # a partial's arguments, a method's self, default arguments (a cache={})
        spaces = _namespaces(functions, model)
        self.globals = [(ns, dict(ns)) for ns in spaces]
        self.classes = [(cls, dict(vars(cls))) for cls in _classes(spaces, model)]
        self.cells = [(cell, _contents(cell)) for f in functions for cell in f.__closure__ or ()]
        held = [*objects, *(v for ns in spaces for v in ns.values()), *(c for _, c in self.cells)]
        plain = [o for o in held if _plain(o)]
        self.objects = [(o, dict(vars(o))) for o in {id(o): o for o in plain}.values()]
        sources = [*held, *(v for o in plain for v in vars(o).values())]
        sources += [v for _, saved in self.classes for v in saved.values()]
        self.generators = [(g, _state(g)) for g in {id(g): g for g in sources if _generator(g)}.values()]
        self.made: list[weakref.ref[torch.Tensor]] = []

    def watch(self, t: torch.Tensor) -> None:
        self.made.append(weakref.ref(t))

    def __enter__(self) -> Guard:
        return self

    def __exit__(self, kind: Any, exc: BaseException | None, tb: Any) -> None:
        if exc is not None:  # its frames hold the trace's tensors: the message is what is kept
            _clear_frames(exc)
        for g, state in self.generators:
            _set_state(g, state)
        for ns, saved in self.globals:
            _put_back(ns, saved, ns.__setitem__, ns.__delitem__)
        for cls, saved in self.classes:
            _put_back(vars(cls), saved, functools.partial(setattr, cls), functools.partial(delattr, cls))
        for o, saved in self.objects:
            _put_back(vars(o), saved, vars(o).__setitem__, vars(o).__delitem__)
        for cell, contents in self.cells:
            if _contents(cell) is contents:
                continue
            if contents is _MISSING:
                del cell.cell_contents
            else:
                cell.cell_contents = contents
        self._take_out_kept()

    def _alive(self) -> list[torch.Tensor]:
        return [t for ref in self.made if (t := ref()) is not None]

    def _take_out_kept(self) -> None:
        """Most traces leave nothing: the check is a look at the weak references. A kept tensor is looked
        for first where scripts keep them (the caches among the saved namespaces: no heap walk), then,
        after a garbage collection (a cycle may hold it), among every object's referrers."""
        kept = self._alive()
        if not kept:
            return
        ids = {id(t) for t in kept}  # stable while `kept` holds them
        for holder in _caches(self._held()):
            _take_out_of(holder, functools.partial(_holds, ids))
        del kept
        if not self._alive():
            return
        gc.collect()
        kept = self._alive()
        if not kept:
            return
        places = _take_out(kept)
        del kept
        gc.collect()
        if self._alive():
            where = ", ".join(dict.fromkeys(places)) or "somewhere gputui cannot reach"
            raise Unsafe(f"the step kept a tensor of the planner's trace in {where}: it cannot be taken back")

    def _held(self) -> list[Any]:
        """What the saved namespaces hold now."""
        held = [*self.carried, *(v for ns, _ in self.globals for v in ns.values())]
        held += [v for cls, _ in self.classes for v in vars(cls).values()]
        held += [v for o, _ in self.objects for v in vars(o).values()]
        return held + [c for cell, _ in self.cells if (c := _contents(cell)) is not _MISSING]


def _unwrapped(step: Callable[..., Any]) -> tuple[list[types.FunctionType], list[Any]]:
    """The functions a step runs as itself and those it carries (through partials, bound methods,
    callable objects, closures and default arguments), and the other objects those carry."""
    functions: list[types.FunctionType] = []
    objects: list[Any] = []
    todo: list[Any] = [step]
    seen: set[int] = set()
    while todo and len(seen) < _FUNCTIONS:
        f = todo.pop()
        if id(f) in seen:
            continue
        seen.add(id(f))
        if isinstance(f, functools.partial):
            todo += [f.func, *f.args, *f.keywords.values()]
        elif isinstance(f, types.MethodType):
            todo += [f.__func__, f.__self__]
        elif isinstance(f, types.FunctionType):
            functions.append(f)
            carried = [_contents(c) for c in f.__closure__ or ()]
            carried += [*(f.__defaults__ or ()), *(f.__kwdefaults__ or {}).values()]
            todo += [v for v in carried if v is not _MISSING]
        elif not isinstance(f, type) and callable(f) and not isinstance(f, nn.Module):
            objects.append(f)
            todo.append(type(f).__call__)
        else:
            objects.append(f)
    return functions, objects


def _caches(values: Iterable[Any], depth: int = 2, largest: int = 100_000) -> list[Any]:
    """The containers among `values` and inside them (a dict of dicts of masks): where scripts keep
    what they made, looked through without walking the heap."""
    found: dict[int, Any] = {}
    level = list(values)
    for _ in range(depth):
        level = [v for v in level if isinstance(v, _CACHES) and id(v) not in found]
        found |= {id(v): v for v in level}
        level = [x for c in level if not isinstance(c, functools._lru_cache_wrapper) and len(c) <= largest
                 for x in (c.values() if isinstance(c, dict) else c)]  # fmt: skip
    return list(found.values())


def _namespaces(functions: Iterable[types.FunctionType], model: nn.Module) -> list[dict[str, Any]]:
    """The globals of the script's own modules the step and the model run in, and of the own modules and
    functions those hold (one level: the helpers a script imports)."""
    found: dict[int, dict[str, Any]] = {}

    def add(ns: Any) -> None:
        if isinstance(ns, dict) and id(ns) not in found and _own(ns):
            found[id(ns)] = ns

    for f in functions:
        add(f.__globals__)
    for cls in {type(m) for m in model.modules()}:
        add(getattr(sys.modules.get(cls.__module__), "__dict__", None))
    for ns in list(found.values()):
        for value in list(ns.values()):
            code = value.__wrapped__ if isinstance(value, functools._lru_cache_wrapper) else value
            if isinstance(code, types.FunctionType):
                add(code.__globals__)
            elif isinstance(value, types.ModuleType):
                add(vars(value))
    return list(found.values())


def _classes(spaces: Iterable[dict[str, Any]], model: nn.Module) -> list[type]:
    """The script's own classes: those its modules define and the model's (class attributes a step may set)."""
    candidates = [v for ns in spaces for v in ns.values() if isinstance(v, type)]
    candidates += [type(m) for m in model.modules()]
    own = {id(c): c for c in candidates if _own(getattr(sys.modules.get(c.__module__), "__dict__", {}))}
    return list(own.values())


@functools.cache
def _libraries() -> tuple[str, ...]:
    """Where the standard library, installed packages and gputui live: not the script's own modules (a
    library's lazily set globals are its own business, and restoring them could undo its setup)."""
    paths = sysconfig.get_paths()
    roots = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")} | {os.path.dirname(__file__)}
    return tuple(os.path.join(os.path.realpath(root), "") for root in roots)


def _own(ns: dict[str, Any]) -> bool:
    file = ns.get("__file__")
    if not isinstance(file, str):
        return ns.get("__name__") == "__main__"
    return not os.path.realpath(file).startswith(_libraries())


def _plain(o: Any) -> bool:
    """An object whose attributes a step may set: not a module, class, function or tensor."""
    skipped = (type, types.ModuleType, types.FunctionType, types.MethodType, types.BuiltinFunctionType, torch.Tensor)
    return isinstance(getattr(o, "__dict__", None), dict) and not isinstance(o, skipped)


def _contents(cell: types.CellType) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # empty
        return _MISSING


def _put_back(now: Any, saved: dict[str, Any], set_: Callable[[str, Any], None], del_: Callable[[str], None]) -> None:
    """Each name rebound, added or deleted since `saved` as it was (dunder names are the interpreter's:
    a warning's registry, a module's own)."""
    for name in {*now, *saved}:
        old = saved.get(name, _MISSING)
        if now.get(name, _MISSING) is old or (name.startswith("__") and name.endswith("__")):
            continue
        if old is _MISSING:
            del_(name)
        else:
            set_(name, old)


def _generator(o: Any) -> bool:
    if isinstance(o, torch.Generator) or (isinstance(o, random.Random) and not isinstance(o, random.SystemRandom)):
        return True
    numpy_random = sys.modules.get("numpy.random")
    return numpy_random is not None and isinstance(o, (numpy_random.Generator, numpy_random.RandomState))


def _state(g: Any) -> Any:
    if isinstance(g, random.Random):
        return g.getstate()
    if isinstance(g, torch.Generator):
        return g.get_state()
    if hasattr(g, "bit_generator"):  # NumPy's Generator
        return g.bit_generator.state
    return g.get_state()  # NumPy's RandomState


def _set_state(g: Any, state: Any) -> None:
    if isinstance(g, random.Random):
        g.setstate(state)
    elif isinstance(g, torch.Generator):
        g.set_state(state)
    elif hasattr(g, "bit_generator"):
        g.bit_generator.state = state
    else:
        g.set_state(state)


def _clear_frames(exc: BaseException | None) -> None:
    """The finished frames of an exception and its causes, cleared (their locals are the trace's)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__


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
    todo = list({id(m): m for t in kept if (m := vars(t).get("fake_mode")) is not None}.values())
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
    if isinstance(holder, functools._lru_cache_wrapper):
        # the results, or (unbounded) the dict of them: clearing a cache changes no result
        if any(has(r) or (isinstance(r, dict) and any(map(has, r.values()))) for r in gc.get_referents(holder)):
            holder.cache_clear()
        return None
    if isinstance(holder, dict):
        names = [k for k, v in holder.items() if has(v) or has(k)]
        if not names:
            return None
        owner = owner_of(holder) if owner_of is not None else None
        if isinstance(owner, functools._lru_cache_wrapper):  # an unbounded lru_cache's own dict
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
        if isinstance(r, functools._lru_cache_wrapper) or getattr(r, "__dict__", None) is d:
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
