"""What the observer (engine/observe.py) patches in torch to see a script's own loop: backward() for its
losses, the optimizer's constructor to find it, the DataLoader's iterator for the batches fetched, zero_grad
for the gradients freed, GradScaler.scale for the unscaled loss, torch.compile to hide the hooks from
dynamo. Each but the last stands aside while gputui.fit trains (`observer.fitting`): fit's own scaled
losses are no backward() the observer reads, and kept they would pile up, one a micro-batch."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.utils.data.dataloader as dataloader_module

Patch = tuple[Any, str, Callable[..., Any]]
"""(owner, attribute, what it is set to while the script runs)."""


def patches(observer: Any) -> list[Patch]:
    """The patches for `observer`, each wrapping the attribute it replaces (read now)."""
    original_backward = torch.autograd.backward
    original_init = torch.optim.Optimizer.__init__
    original_next = dataloader_module._BaseDataLoaderIter.__next__
    original_scale = torch.amp.GradScaler.scale
    original_compile = torch.compile

    def backward(tensors: Any, *args: Any, **kwargs: Any) -> Any:
        if not observer.fitting:
            observer.note_backward(tensors)
            observer.batches.consume()
        observer.phase, observer.failed_in = "backward", None
        try:
            return original_backward(tensors, *args, **kwargs)
        except BaseException:
            observer.failed_in = "backward"  # for the diagnosis, if this ends the script
            raise
        finally:
            observer.phase = None
            if observer.tracker is not None and not observer.fitting:
                observer.tracker.end_micro_batch()

    def init(optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
        original_init(optimizer, *args, **kwargs)
        if observer.optimizer is None and not observer.fitting:
            observer.found_optimizer(optimizer)

    def next_batch(iterator: Any) -> Any:
        try:
            batch = original_next(iterator)
        except StopIteration:
            if not observer.fitting:
                observer.batches.exhausted(iterator)
            raise
        if not observer.fitting:
            observer.batches.fetched(iterator, batch)
        return batch

    def zero_grad(original: Any) -> Any:
        def wrapper(owner: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(owner, *args, **kwargs)
            if observer.tracker is not None and not observer.fitting:
                observer.tracker.sync_grads()  # set_to_none freed them: stop counting them
            return result

        return wrapper

    def scale(scaler: Any, outputs: Any) -> Any:
        scaled = original_scale(scaler, outputs)
        if not observer.fitting and isinstance(outputs, torch.Tensor) and outputs.numel() == 1:
            observer.unscaled[id(scaled)] = outputs.detach()
        return scaled

    def compile(*args: Any, **kwargs: Any) -> Any:
        compiled = original_compile(*args, **kwargs)
        observer.hide_hooks()
        return compiled

    return [
        (torch.autograd, "backward", backward),
        (torch.optim.Optimizer, "__init__", init),
        (dataloader_module._BaseDataLoaderIter, "__next__", next_batch),
        (torch.amp.GradScaler, "scale", scale),
        (torch.optim.Optimizer, "zero_grad", zero_grad(torch.optim.Optimizer.zero_grad)),
        (torch.nn.Module, "zero_grad", zero_grad(torch.nn.Module.zero_grad)),
        (torch, "compile", compile),
    ]
