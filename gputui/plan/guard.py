"""What a trace may leave in the script's own objects, put back: names rebound, generators drawn, fakes kept.

predict() runs the script's step() on a fake copy of the model, but the step's own code runs for
real: it may rebind a global or a closure variable (a call counter, a lazily made mask), draw from a
generator of its own, or keep a tensor it made in a cache (an lru_cache, a module-level dict). The next
real step would find a fake tensor there and die ("Please convert all Tensors to FakeTensors first"),
and a plan would change what the run draws. So, around a trace:

- the script's namespaces (the globals of its own modules, the step's and those it imports; its
  classes'; the step's closure; the attributes of the objects they hold) are saved and put back;
- the generators among them (random.Random, NumPy's Generator and RandomState, torch.Generator) too,
  and the process-wide ones (torch's on the CPU and the step's GPU, Python's, NumPy's): fake ops draw
  nothing, but the step's own code may (the model's generators are copied with it);
- every tensor the trace made is watched weakly, and those the script kept are taken out (kept.py).

What a trace writes to a file or a socket, or prints, cannot be taken back (README, "The planner").
"""

from __future__ import annotations

import functools
import os
import random
import sys
import sysconfig
import traceback
import types
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import private
from .kept import take_out_kept

_MISSING = object()
_FUNCTIONS = 64
"""Functions and objects followed from the step (its closures, defaults, partials): a bound on the walk."""


class Guard:
    """Saves what the script's `step` and `model` could change before a trace on `device`; `watch` each
    tensor the trace makes. On exit, once the trace is gone: everything put back, kept tensors taken out,
    or Unsafe."""

    def __init__(self, step: Callable[..., Any], model: nn.Module, device: torch.device) -> None:
        self.process = _process_generators(device)
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
        for put, state in self.process:
            put(state)
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
        take_out_kept(self.made, self._held)

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
            code = value.__wrapped__ if isinstance(value, private.LruCache) else value
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
    roots = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")} | {str(Path(__file__).parents[1])}
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


def _process_generators(device: torch.device) -> list[tuple[Callable[[Any], object], Any]]:
    """The process-wide generators a step may draw from, each as (how to put a state back, its state now)."""
    saved: list[tuple[Callable[[Any], object], Any]] = [
        (torch.set_rng_state, torch.get_rng_state()),
        (random.setstate, random.getstate()),
    ]
    if device.type == "cuda" and torch.cuda.is_initialized():
        saved.append((functools.partial(torch.cuda.set_rng_state, device=device), torch.cuda.get_rng_state(device)))
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        saved.append((numpy_random.set_state, numpy_random.get_state()))
    return saved


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
