"""Every private API the planner relies on, and only here: torch's fake tensors, dispatch modes and pytree,
private attributes of storages, modules, optimizers and compiled models, and functools' lru_cache type.
None is promised to stay as it is: a torch or Python release that changes one is mended in this module,
not across the planner.

The fake tensor module is imported on first use: it imports torch._dynamo and torch._inductor (a second,
and their exit handlers), which a run that never traces should not pay.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

DispatchMode = TorchDispatchMode
"""The base of a mode that sees every op below autograd, its arguments and its outputs."""

LruCache = functools._lru_cache_wrapper
"""What functools.lru_cache makes of a function: a cache a script may keep a trace's tensors in."""

LOCAL_SCALAR = torch.ops.aten._local_scalar_dense.default
"""The op behind .item() and bool() of a tensor: a fake tensor has no value to give it."""

LIFTS = (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default)
"""The ops torch.tensor(...) makes a tensor through: under the fake mode, already a fake constant."""

_OWN_TENSORS = ("_parameters", "_buffers")


def leaves(tree: Any) -> list[Any]:
    """What an op's output holds: its tensors among the rest."""
    return pytree.tree_leaves(tree)


def storage_key(storage: torch.UntypedStorage) -> int:
    """A storage's identity, the same from every tensor on it (a storage object is made per call)."""
    return storage._cdata


def is_constant(t: torch.Tensor) -> bool:
    """A fake tensor that keeps its value (an optimizer's step count): .item() of it is exact."""
    return getattr(t, "constant", None) is not None


def fake_mode_of(t: torch.Tensor) -> Any:
    """The fake tensor mode a fake tensor belongs to; None for any other tensor."""
    return vars(t).get("fake_mode")


def allocator_settings() -> str:
    """The caching allocator's settings as the process set them (PYTORCH_ALLOC_CONF, or its CUDA name, or
    set at run time); a torch without the accessor has only the environment's."""
    read = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    if read is not None:
        return str(read())
    return os.environ.get("PYTORCH_ALLOC_CONF") or os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")


def fake_tensor_mode() -> Any:
    """A fake tensor mode in which every tensor must be fake (a real one is a bug of the copy's)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=False)


def forget_reals(mode: Any) -> None:
    """Drop the fake mode's weak references to the real tensors and storages it converted. The mode is
    cyclic garbage once its trace ends: with the collector off during training and on again after (a
    script's gc.disable() ... gc.enable()), it stayed, its weak references on the batch's storages with it,
    and freeing the batch then crashed the process (SIGSEGV in PyObject_ClearWeakRefs; torch 2.13, CPU)."""
    describer = mode.fake_tensor_converter.meta_converter.describer
    describer.lookup_tensor.clear()
    describer.lookup_storage.clear()


def fake_tensor_type() -> type:
    from torch._subclasses.fake_tensor import FakeTensor

    return FakeTensor


def real_value(t: torch.Tensor) -> bool | int | float | complex:
    """.item() of a real tensor, read inside the trace: the current modes must not see it."""
    with _disable_current_modes():
        return t.item()


def to_fake(mode: Any, t: torch.Tensor, constant: bool) -> torch.Tensor:
    """`t`'s fake in `mode`: shapes, dtype and device; `constant` keeps a copy of its value too. Also called
    from inside the trace's dispatch, where the current modes must not see the conversion."""
    with _disable_current_modes():
        if constant:
            converter = mode.fake_tensor_converter
            return converter.from_real_tensor(mode, t.detach().clone(), make_constant=True)
        return mode.from_tensor(t.detach())


def data_dependent(exc: Exception) -> str | None:
    """ "value" where the fake mode failed for want of a tensor's value, "shape" for want of a shape that
    depends on the data, None for any other failure."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

    if isinstance(exc, DataDependentOutputException):
        return "value"
    if isinstance(exc, DynamicOutputShapeException):
        return "shape"
    return None


def plain_attributes(module: nn.Module) -> Iterator[Any]:
    """The values a module keeps as plain attributes (masks, caches), not its parameters or buffers."""
    return (value for name, value in vars(module).items() if name not in _OWN_TENSORS)


def own_parameters(module: nn.Module) -> Iterator[nn.Parameter]:
    """The module's own parameters, without its children's (and without a name-mangling walk)."""
    return (p for p in module._parameters.values() if p is not None)


def own_buffers(module: nn.Module) -> Iterator[torch.Tensor]:
    return (b for b in module._buffers.values() if b is not None)


def eager(model: nn.Module) -> tuple[nn.Module, bool]:
    """The eager model under torch.compile's wrapper, and whether it was compiled."""
    if type(model).__name__ == "OptimizedModule":
        return model._orig_mod, True  # type: ignore[return-value]
    return model, False


def optimizer_shell(real: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """An optimizer of `real`'s class and options to fill in: without the step hooks (the script's run on
    its real steps) and without an LR scheduler's wrapper of the real optimizer's step."""
    shell = object.__new__(type(real))
    shell.__dict__.update(real.__dict__)
    shell.__dict__.pop("step", None)
    shell._optimizer_step_pre_hooks, shell._optimizer_step_post_hooks = {}, {}
    return shell


def unhooked_step(optimizer: torch.optim.Optimizer) -> None:
    """The optimizer class's own step, without the hooks torch wraps around it (the script's own and the
    global ones would see a step that never happened) and without an LR scheduler's instance wrapper."""
    step: Any = type(optimizer).step
    if getattr(step, "hooked", False):  # Optimizer._patch_step_function's wrapper
        step = step.__wrapped__
    step(optimizer)


def default_kernels(params: list[torch.Tensor]) -> tuple[bool, bool]:
    """(fused, foreach) as torch picks them for these real parameters (never for a tensor subclass)."""
    from torch.optim.optimizer import _default_to_fused_or_foreach

    fused, foreach = _default_to_fused_or_foreach(params, differentiable=False, use_fused=False)
    return bool(fused), bool(foreach)
