"""The fake copy a trace runs on: the model, its optimizer and the batch with every tensor a FakeTensor
(shapes, dtypes and devices, no data). The copy shares no tensor with the run: a deepcopy whose memo
maps each real tensor to its fake, and the optimizer rebuilt over the fake parameters with fake state."""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from ..step.checkpointing import strip_wrappers
from ..step.microbatch import map_tensors
from . import private
from .prediction import Untraceable, line


class FakeCopy:
    """A run's model, optimizer and batch, faked once in `mode` (a fake tensor mode); `watch` is told each
    fake made."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        batch: Any,
        watch: Callable[[torch.Tensor], None],
        mode: Any,
    ) -> None:
        self.exact_reason: str | None = None  # why a trace of this copy is approximate, if it is
        self.watch = watch  # each fake made: the Guard looks for those the script kept
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module  # one rank's step: its buckets are outside the trace (the correction has them)
        model, compiled = private.eager(model)
        if compiled:  # compiled may hold less
            self.exact_reason = "compiled model traced eagerly"
        odd = next((p for p in model.parameters() if type(p) is not nn.Parameter and type(p) is not torch.Tensor), None)
        if odd is not None and is_lazy(odd):
            raise Untraceable("parameters not made yet (a Lazy module before its first forward): train a step first")
        if odd is not None:
            kind = type(odd).__name__  # FSDP's sharded ones, say
            raise Untraceable(f"parameters of type {kind}: each rank's step cannot be traced alone")
        self.mode = mode
        self.fake_type = private.fake_tensor_type()
        self.fakes: dict[int, torch.Tensor] = {}
        self._kept: list[torch.Tensor] = []  # the real tensors faked: alive while the copy is, so no id is reused
        memo: dict[int, Any] = {}
        for module in model.modules():
            for value in private.plain_attributes(module):  # tensors kept as plain attributes (masks, caches)
                for t in _held(value):
                    if isinstance(t, torch.Tensor):
                        memo[id(t)] = self.fake(t)
            for p in private.own_parameters(module):
                if id(p) not in memo:
                    memo[id(p)] = self.fake(p).requires_grad_(p.requires_grad)
            for b in private.own_buffers(module):
                if id(b) not in memo:
                    memo[id(b)] = self.fake(b)
        try:
            self.model: nn.Module = copy.deepcopy(model, memo)
        except Exception as exc:
            raise Untraceable(f"the model cannot be copied: {line(exc)}") from exc
        self.copies = memo  # id(real module) -> its copy, among the rest
        strip_wrappers(self.model)
        self.optimizer = self._optimizer(optimizer)
        self.batch = map_tensors(batch, self.fake)

    def fake(self, t: torch.Tensor, constant: bool = False) -> torch.Tensor:
        """`t`'s fake, made once (by id: `t` is kept alive until the copy goes, so no id is reused).
        Also called from inside the trace's dispatch, for a real tensor the step brings itself."""
        key = id(t)
        if key not in self.fakes:
            fake = private.to_fake(self.mode, t, constant)
            self.fakes[key] = fake
            self._kept.append(t)
            self.watch(fake)
        return self.fakes[key]

    def _optimizer(self, real: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """`real` rebuilt over the fake parameters: same class, groups and options, state as fakes
        (scalars as constants, so an optimizer reading `step` as a number still can), and foreach/fused
        as torch would choose on the real device (it never picks them for a tensor subclass)."""
        fake = private.optimizer_shell(real)
        groups = []
        for group in real.param_groups:
            params = list(group["params"])
            copied = {k: (self.fake(v, constant=True) if isinstance(v, torch.Tensor) else v) for k, v in group.items()}
            copied["params"] = [self._fake_param(p) for p in params]
            if copied.get("foreach") is None and not copied.get("fused") and "foreach" in real.defaults:
                fused, foreach = private.default_kernels(params)
                copied["foreach"] = foreach and not fused
            groups.append(copied)
        fake.param_groups = groups
        state: dict[Any, Any] = {}
        for p, entries in real.state.items():
            if isinstance(p, torch.Tensor) and id(p) in self.fakes:
                state[self.fakes[id(p)]] = {
                    k: (self.fake(v, constant=v.numel() <= 1) if isinstance(v, torch.Tensor) else copy.copy(v))
                    for k, v in entries.items()
                }
        fake.state = defaultdict(dict, state)
        return fake

    def _fake_param(self, p: torch.Tensor) -> torch.Tensor:
        """The model's fake of `p`; a parameter the optimizer holds beyond the model gets its own."""
        if id(p) not in self.fakes:
            self.fake(p).requires_grad_(p.requires_grad)
        return self.fakes[id(p)]


def _held(value: Any) -> Iterable[Any]:
    """What a module attribute holds: the items of a list, tuple or dict, or the value itself."""
    if isinstance(value, dict):
        return value.values()
    return value if isinstance(value, (list, tuple)) else (value,)
