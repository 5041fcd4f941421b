"""Activation checkpointing over a model's repeated blocks, switched by one flag at a step boundary
(or a Hugging Face model's own switch): the step runs the same code either way. The planner switches
it on its fake copy of the model with the same class (`Checkpointing.force`)."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.parameter import is_lazy
from torch.utils.checkpoint import checkpoint


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks: the ModuleList/Sequential of same-type children (two or more)
    that holds the most parameters. Empty if there is none."""
    best: list[nn.Module] = []
    best_params = 0
    for module in model.modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(module.children())
        if len(children) < 2 or any(type(c) is not type(children[0]) for c in children):
            continue
        params = sum(p.numel() for p in module.parameters() if not is_lazy(p))  # a Lazy module's: not made yet
        if params > best_params:
            best, best_params = children, params
    return best


def find_hugging_face(model: nn.Module) -> nn.Module | None:
    """The outermost Hugging Face model that can checkpoint: `model` itself, or one a wrapper holds."""
    for module in model.modules():
        if getattr(module, "supports_gradient_checkpointing", False) and (
            hasattr(module, "activation_checkpointing_enable") or hasattr(module, "gradient_checkpointing_enable")
        ):
            return module
    return None


_LAYER = ("gradient_checkpointing", "_gradient_checkpointing_func")
_INPUT_HOOKS = ("_require_grads_hooks", "_require_grads_hook")
_UNSET = object()
_WRAPPERS: weakref.WeakValueDictionary[int, Callable[..., Any]] = weakref.WeakValueDictionary()
"""Every block wrapper a Checkpointing installed and that is still alive, by id."""


def strip_wrappers(model: nn.Module) -> None:
    """A deep copy of a model a Checkpointing wrapped, without the wrappers: deepcopy keeps a function
    as it is, so each of the copy's blocks would still call the block its wrapper was made for."""
    for module in model.modules():
        forward = vars(module).get("forward")
        if forward is not None and _WRAPPERS.get(id(forward)) is forward:
            del module.forward


def _attributes(module: nn.Module, names: Sequence[str]) -> tuple[Any, ...]:
    """The module's own values (not its class's) of `names`; _UNSET where it has none."""
    return tuple(vars(module).get(name, _UNSET) for name in names)


def _hooks(values: Sequence[Any]) -> list[Any]:
    """The input-embedding hooks in `_INPUT_HOOKS`' values: a list (transformers 5), the first alone (4)."""
    many, one = values
    return [*(many if isinstance(many, list) else ()), *(() if one is None or one is _UNSET else (one,))]


def _put(module: nn.Module, names: Sequence[str], values: Sequence[Any]) -> None:
    for name, value in zip(names, values, strict=True):
        if value is _UNSET:
            vars(module).pop(name, None)
        else:
            setattr(module, name, value)


class _HuggingFace:
    """A Hugging Face model's own checkpointing, switched without losing what the script set.

    transformers marks each layer that checkpoints with a `gradient_checkpointing` flag and the
    `_gradient_checkpointing_func` it calls (the contract its own models and `is_*_checkpointing`
    follow since 4.35). `activation_checkpointing_enable()` (`gradient_checkpointing_enable()` before
    transformers 5, deprecated since) sets both and hooks the input embeddings; it is called at most
    once, and only if the script had not enabled it. Off clears the flags, as the library's disable
    does; on puts back the flags and functions last enabled, so the script's own choices
    (`use_reentrant`, `every_n_layers`, `offload`) survive a toggle, and `restore()` leaves the
    model as it came.
    """

    def __init__(self, model: Any) -> None:
        self.model = model
        self._before = self._layers()
        self._hooks_before = _attributes(model, _INPUT_HOOKS)
        name = "is_activation_checkpointing"  # `is_gradient_checkpointing` warns from transformers 5 on
        self.initially = bool(getattr(model, name if hasattr(type(model), name) else "is_gradient_checkpointing"))
        self._enabled = self._before if self.initially else None

    def _layers(self) -> dict[Any, tuple[Any, ...]]:  # Any: nn.Module types its attributes as tensors
        return {m: _attributes(m, _LAYER) for m in self.model.modules() if hasattr(m, "gradient_checkpointing")}

    def force(self, on: bool, function: Callable[..., Any]) -> None:
        """Every layer's flag set to `on`, and on, `function` as what it checkpoints with, whatever was
        enabled before (the planner's copy: no choice of the script's must survive there)."""
        for module in self._layers():
            module.gradient_checkpointing = on
            if on:
                module._gradient_checkpointing_func = function

    def set(self, on: bool) -> None:
        if not on:
            for module in self._layers():
                module.gradient_checkpointing = False
        elif self._enabled is not None:
            for module, values in self._enabled.items():
                _put(module, _LAYER, values)
        else:
            kwargs = {"use_reentrant": False}
            if hasattr(self.model, "activation_checkpointing_enable"):
                self.model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            else:
                self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
            self._enabled = self._layers()

    def restore(self) -> None:
        for module, values in self._before.items():
            _put(module, _LAYER, values)
        kept = _hooks(self._hooks_before)
        for hook in _hooks(_attributes(self.model, _INPUT_HOOKS)):
            if not any(hook is old for old in kept):
                hook.remove()  # one the enable above added
        _put(self.model, _INPUT_HOOKS, self._hooks_before)


class Checkpointing:
    """Activation checkpointing over the model's repeated blocks, switched by one flag.

    Each block's `forward` is shadowed once, on the instance (the module tree and the
    state_dict are untouched), by a wrapper that reads the flag: on, it calls
    `torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`; off, the original forward.
    A Hugging Face model (or one inside a wrapper) uses its own checkpointing instead, and starts
    as the script left it (`enabled`). `remove()` restores the model exactly; `enabled` keeps what
    the run trained with last, for the run's end record.
    """

    def __init__(
        self, model: nn.Module, modules: Sequence[nn.Module] | None = None, *, preserve_rng_state: bool = True
    ) -> None:
        self.on_inputs: Callable[[tuple[Any, ...]], object] | None = None
        """Told each checkpointed block's inputs: the checkpoint keeps them alive for backward."""
        self.preserve_rng_state = preserve_rng_state
        """False for the planner's copy: its fake dropout draws nothing and its devices may not be
        initialized, so no RNG is saved and restored around a recompute."""
        self._installed: list[tuple[nn.Module, Any]] = []
        hf = find_hugging_face(model) if modules is None else None
        self.hf = _HuggingFace(hf) if hf is not None else None
        self.enabled = self.hf is not None and self.hf.initially
        self.blocks: list[nn.Module] = [] if self.hf else list(modules) if modules is not None else find_blocks(model)

    @property
    def how(self) -> str:
        return (
            "hugging face"
            if self.hf
            else f"{len(self.blocks)} x {type(self.blocks[0]).__name__}"
            if self.blocks
            else "none"
        )

    def unavailable(self) -> str | None:
        if self.hf or self.blocks:
            return None
        return (
            "no repeated blocks found (no ModuleList/Sequential of same-type layers): "
            "pass checkpoint_modules=[...] to fit()"
        )

    def set(self, on: bool) -> None:
        if on == self.enabled:
            return
        reason = self.unavailable()
        if on and reason:
            raise ValueError(reason)
        if self.hf:
            self.hf.set(on)
        elif on and not self._installed:
            for block in self.blocks:
                self._install(block)
        self.enabled = on

    def force(self, on: bool) -> None:
        """`set(on)` for a copy of a model: a Hugging Face model's layers all switched to checkpoint as the
        blocks here do, whatever the script had enabled (a copy keeps the functions it was copied with)."""
        if on and self.unavailable():
            raise ValueError(self.unavailable())
        if self.hf:
            self.hf.force(
                on, functools.partial(checkpoint, use_reentrant=False, preserve_rng_state=self.preserve_rng_state)
            )
        elif on and not self._installed:
            for block in self.blocks:
                self._install(block)
        self.enabled = on

    def _install(self, block: nn.Module) -> None:
        own = block.__dict__.get("forward")  # an instance forward someone set before us
        original = block.forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            if self.enabled and torch.is_grad_enabled():
                # Compiled, the graph saves what it keeps for backward itself (the tracker's pack
                # hook counts it), and a call out of the graph here would break it at every block.
                if self.on_inputs is not None and not torch.compiler.is_compiling():
                    self.on_inputs(args)
                return checkpoint(
                    original, *args, use_reentrant=False, preserve_rng_state=self.preserve_rng_state, **kwargs
                )
            return original(*args, **kwargs)

        _WRAPPERS[id(forward)] = forward
        block.forward = forward
        self._installed.append((block, own))

    def remove(self) -> None:
        if self.hf:
            self.hf.restore()
        for block, own in self._installed:
            if own is None:
                del block.forward
            else:
                block.forward = own
        self._installed = []
