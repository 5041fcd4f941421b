"""Recognising an out-of-memory error, and putting back what a failed attempt changed (the
generators, the running statistics) so a retry replays the same step."""

from __future__ import annotations

import random
import sys
import traceback
import types
from dataclasses import dataclass
from time import monotonic
from typing import Any

import torch
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.parameter import is_lazy

from .result import FitError, first_line

# Errors that are out-of-memory in all but type: cuBLAS/cuDNN, the MPS backend and the CPU
# allocator raise plain RuntimeErrors when memory cannot be had.
_OOM_TEXTS = (
    "out of memory",
    "can't allocate memory",  # the CPU allocator
    "CUBLAS_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_ALLOC_FAILED",
)
CUDNN_NOT_SUPPORTED = "CUDNN_STATUS_NOT_SUPPORTED"
NEAR_FULL = 0.9
"""cuDNN's NOT_SUPPORTED is an OOM only with this share of what the process can have reserved."""


def is_oom(exc: BaseException) -> bool:
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    if not isinstance(exc, RuntimeError):
        return False
    text = str(exc)
    if CUDNN_NOT_SUPPORTED in text:
        return cuda_nearly_full()
    return any(t in text for t in _OOM_TEXTS)


def cuda_nearly_full() -> bool:
    """cuDNN says NOT_SUPPORTED when no algorithm's workspace can be had, and as well when it has no kernel
    for a configuration (a dtype, a layout, a shape too large for its indexing): only the first comes with
    memory near full. Near: reserved within 10 % of what this process can have (what it reserves and what
    the device has free, or less under a cap), read while the failed step's tensors are still held."""
    if not torch.cuda.is_initialized():
        return False
    device = torch.cuda.current_device()
    reserved = torch.cuda.memory_reserved(device)
    try:
        free, total = torch.cuda.mem_get_info(device)
    except RuntimeError:  # a context the error left unusable: nothing to recover
        return False
    can_have = reserved + free
    capped = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # torch >= 2.7
    fraction = capped(device) if capped is not None else 1.0
    if fraction < 1:
        can_have = min(can_have, int(fraction * total))
    return reserved >= NEAR_FULL * can_have


def cudnn_error(exc: BaseException) -> FitError | None:
    """The FitError a step raises for cuDNN's NOT_SUPPORTED that is not an out-of-memory (is_oom said no:
    memory is far from full), which halving would only walk down to one sample; None for any other error."""
    if not (isinstance(exc, RuntimeError) and CUDNN_NOT_SUPPORTED in str(exc)):
        return None
    return FitError(
        "cuDNN has no kernel for this configuration (CUDNN_STATUS_NOT_SUPPORTED with memory far from full, so "
        "not an out-of-memory): a dtype, layout or size it does not support, or a non-contiguous input; "
        f"torch.backends.cudnn.enabled = False runs the step without cuDNN [{first_line(exc)}]"
    )


def drop(exc: BaseException) -> str:
    """The one line worth keeping of an OOM; its frames are cleared so the tensors they hold die.

    The traceback keeps every frame of the failed step alive, and with them its activations:
    the classic reason memory does not come back after a caught OOM.
    """
    message = first_line(exc)
    traceback.clear_frames(exc.__traceback__)
    exc.__traceback__ = None
    exc.__context__ = None
    return message


@dataclass
class OomInfo:
    phase: str  # "forward", "backward" or "optimizer"
    message: str
    micro_batch: int
    allocated_before: int


class _HostGenerator:
    """A process-wide generator a step may draw from: Python's `random`, NumPy's global one.

    Saving one costs 8-70 us (Python's state is 625 ints, NumPy's get_state() ~30 us) and most
    steps never draw from them (data pipelines do, between steps), so a step saves it lazily: a
    trap saves the state on the step's first draw, exactly as it was before it, and disarms
    itself. It stays armed from step to step while nothing draws, and then a step pays nothing
    for it (Generators.start() and end() touch no host); a draw between steps only disarms it, and
    the next start() arms it again. A draw the trap cannot see (through a function bound before it:
    `from random import random`) is caught by comparing the whole state around the first steps and
    every CHECK_EVERY-th, at most one a CHECK_S (a check reads the state twice, ~30 us for NumPy's):
    from then on every step saves it at its start.
    """

    def __init__(self, owner: Generators) -> None:
        self.owner = owner
        self.every_step = False
        self.armed = False
        self.saved: Any = None  # the state before the first draw of step `saved_at` (or at its start)
        self.saved_at = 0
        self.fired = False  # the trap fired since the last checked start
        self.at_start: Any = None  # the state at the start of a checked step

    def get(self) -> Any:
        raise NotImplementedError

    def set(self, state: Any) -> None:
        raise NotImplementedError

    def same(self, a: Any, b: Any) -> bool:
        return a == b

    def _arm(self) -> None:
        raise NotImplementedError

    def _disarm(self) -> None:
        raise NotImplementedError

    def arm(self) -> None:
        if not self.armed:
            self._arm()
            self.armed = True

    def disarm(self) -> None:
        if self.armed:
            self._disarm()
            self.armed = False

    def fire(self) -> None:
        """The trap saw a draw."""
        if self.armed:
            self.disarm()
            self.owner.drawn(self)

    def save(self, step: int, state: Any = None) -> None:
        self.saved, self.saved_at = (self.get() if state is None else state), step

    def step_start(self, step: int) -> Any:
        """The state step `step` started with, if it was saved (None: nothing drew from it yet)."""
        return self.saved if self.saved_at == step else None


class _PythonRandom(_HostGenerator):
    """Python's global generator, `random._inst`: every draw (randint, choice, shuffle, gauss...) goes
    through its random() or getrandbits(), so while armed its class is a subclass whose two methods
    fire the trap. The module's `random` and `getrandbits` were bound to the C methods at import,
    past the class: they are rebound while armed. gauss() may return the value it kept from its last
    call without drawing, through a function the trap may not see (`from random import gauss`):
    Generators keeps `gauss_next` from each step's start."""

    def __init__(self, owner: Generators) -> None:
        super().__init__(owner)
        self.inst = inst = random._inst
        self.plain = plain = type(inst)
        trap = self

        class Armed(plain):  # type: ignore[misc, valid-type]
            def random(self) -> float:
                trap.fire()
                return plain.random(self)

            def getrandbits(self, k: int) -> int:
                trap.fire()
                return plain.getrandbits(self, k)

        self.armed_class = Armed
        names = [n for n in ("random", "getrandbits") if getattr(random, n, None) == getattr(inst, n)]
        self._bound = {n: getattr(random, n) for n in names}
        self._traps = {n: types.MethodType(getattr(Armed, n), inst) for n in names}

    def get(self) -> Any:
        return self.inst.getstate()

    def set(self, state: Any) -> None:
        self.inst.setstate(state)

    def _arm(self) -> None:
        self.inst.__class__ = self.armed_class
        random.__dict__.update(self._traps)

    def _disarm(self) -> None:
        self.inst.__class__ = self.plain
        for name, trap in self._traps.items():
            if random.__dict__.get(name) is trap:  # unless the script rebound it meanwhile
                setattr(random, name, self._bound[name])


class _NumpyRandom(_HostGenerator):
    """NumPy's legacy global generator (np.random.seed, np.random.rand...). Its methods are
    compiled, so the trap is on the module: while armed, numpy.random's class is a subclass whose
    attribute lookup fires the trap when a function of the global generator is looked up."""

    def __init__(self, owner: Generators, module: types.ModuleType) -> None:
        super().__init__(owner)
        self.module = module
        self.rand = rand = module.mtrand._rand
        names = frozenset({n for n, v in vars(module).items() if getattr(v, "__self__", None) is rand} | {"seed"})
        self.plain = plain = type(module)
        trap = self

        class Armed(plain):  # type: ignore[misc, valid-type]
            def __getattribute__(self, name: str) -> Any:
                if name in names:
                    trap.fire()
                return plain.__getattribute__(self, name)

        self.armed_class = Armed

    def get(self) -> Any:
        return self.rand.get_state()

    def set(self, state: Any) -> None:
        self.rand.set_state(state)

    def same(self, a: Any, b: Any) -> bool:
        """The legacy state tuple: (name, keys array, pos, has_gauss, cached_gaussian)."""
        return a[2:] == b[2:] and bool((a[1] == b[1]).all())

    def _arm(self) -> None:
        self.module.__class__ = self.armed_class

    def _disarm(self) -> None:
        self.module.__class__ = self.plain


class Generators:
    """The generators a step may draw from, as they were at its start, put back before a replay:
    torch's (CPU and the device) saved at every start, Python's `random` and NumPy's global one
    on the step's first draw from them (_HostGenerator). A step that draws from neither (most) pays
    for them a flag set and cleared and gauss()'s kept value copied: a step's cost is mostly the
    objects it touches, cold after the model's own work (a microsecond or so each on a CPU step of
    1.5 ms)."""

    CHECK_EVERY = 50
    CHECK_S = 1.0

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._kind = device.type  # read once: a torch.device's .type costs half a microsecond a read
        self._cuda: torch.Generator | None = None  # the device's own, found at the first start
        self.python = _PythonRandom(self)
        self.numpy: _NumpyRandom | None = None  # once numpy.random is imported
        self._hosts: tuple[_HostGenerator, ...] = (self.python,)
        self._every: tuple[_HostGenerator, ...] = ()  # the hosts saved at every start (a draw the trap missed)
        self._starts = 0
        self._checked = 0.0  # when the last checked step started
        self._checking = False  # the step under way compares the hosts' states around it
        self._disarmed = True  # a host to arm at the next start (a draw disarmed it, or none is armed yet)
        self.stepping = False
        self._torch: Any = None
        self._accel: Any = None
        self._gauss_next: float | None = None

    def start(self) -> None:
        """Save torch's generators (the generator objects themselves: torch.get_rng_state() and
        torch.cuda.get_rng_state() add Python frames and device lookups to every step)."""
        self._starts = starts = self._starts + 1
        self._torch = torch.default_generator.get_state()
        if self._kind == "cuda":
            if self._cuda is None:
                torch.cuda.init()  # makes default_generators (the model is on the device already)
                index = self.device.index
                self._cuda = torch.cuda.default_generators[torch.cuda.current_device() if index is None else index]
            self._accel = self._cuda.get_state()
        elif self._kind == "mps":
            self._accel = torch.mps.get_rng_state()
        if self.numpy is None and "numpy.random" in sys.modules:
            self.numpy = _NumpyRandom(self, sys.modules["numpy.random"])
            self._hosts = (self.python, self.numpy)
            self._disarmed = True
        self.stepping = True
        self._gauss_next = self.python.inst.gauss_next  # type: ignore[attr-defined]  # set by Random.__init__
        for host in self._every:
            host.save(starts)
        if self._disarmed:
            self._disarmed = False
            for host in self._hosts:
                if not host.every_step:
                    host.arm()
        if starts <= 3 or (starts % self.CHECK_EVERY == 0 and monotonic() - self._checked >= self.CHECK_S):
            self._checked, self._checking = monotonic(), True
            for host in self._hosts:
                host.fired = False
                host.at_start = host.get()
                host.save(starts, host.at_start)

    def drawn(self, host: _HostGenerator) -> None:
        """`host`'s trap fired (and disarmed it): within a step, its first draw saves the state. In a
        checked step, a state already moved since the start is a draw that went past the trap first."""
        self._disarmed = True
        if self.stepping:
            if self._checking and not host.fired and not host.every_step and not host.same(host.at_start, host.get()):
                self._missed(host)
            host.fired = True
            if host.saved_at != self._starts:
                host.save(self._starts)

    def kept(self) -> list[torch.Tensor]:
        """The device generators' states saved at the step's start (tensors: memory gputui holds)."""
        return [t for t in (self._torch, self._accel) if isinstance(t, torch.Tensor)]

    def restore(self) -> None:
        torch.default_generator.set_state(self._torch)
        if self._cuda is not None:
            self._cuda.set_state(self._accel)
        elif self._kind == "mps":
            torch.mps.set_rng_state(self._accel)
        for host in self._hosts:
            state = host.step_start(self._starts)
            if state is not None:
                host.set(state)
        self.python.inst.gauss_next = self._gauss_next  # type: ignore[attr-defined]  # not in typeshed

    def end(self) -> None:
        """The step is over (trained, stopped or failed)."""
        self.stepping = False
        if self._checking:
            self._check_end()

    def _check_end(self) -> None:
        """A checked step whose state changed with no draw the trap saw: a draw it cannot see, so
        from now on every step saves the state at its start."""
        self._checking = False
        for host in self._hosts:
            if not host.every_step and not host.fired and not host.same(host.at_start, host.get()):
                self._missed(host)
            host.at_start = None

    def _missed(self, host: _HostGenerator) -> None:
        """`host` is drawn from past its trap: from now on it is saved at every start."""
        host.every_step = True
        host.disarm()
        self._every = (*self._every, host)

    def close(self) -> None:
        """fit() returns: the generators and modules as the script left them."""
        for host in self._hosts:
            host.disarm()
        self._disarmed = True


class Buffers:
    """Running statistics (BatchNorm's running_mean, running_var, num_batches_tracked) as they
    were at a step's start: a failed attempt's forward passes updated them, and the replay's
    would again. Only modules that track running statistics are saved (one foreach copy into
    tensors allocated once): for a model without any, a step pays one truth test.

    The same walk counts `batch_norms`: BatchNorm layers that normalize over the batch they are
    given (in training mode, or without running statistics), so micro-batching changes what they
    compute and one sample per micro-batch is an error. InstanceNorm normalizes each sample on its
    own: micro-batching does not change it, and it is not counted."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.live: list[torch.Tensor] = []
        self.batch_norms = 0
        for m in model.modules():
            if getattr(m, "track_running_stats", False):
                self.live.extend(m.buffers(recurse=False))
            if isinstance(m, _BatchNorm) and (m.training or m.running_mean is None):
                self.batch_norms += 1
        self.saved = self._copies()

    def _copies(self) -> list[torch.Tensor] | None:
        """Where save() copies to, or None while a LazyBatchNorm has no buffers yet (its first forward
        makes them: that step's replay cannot put them back)."""
        return None if any(is_lazy(b) for b in self.live) else [b.clone() for b in self.live]

    def save(self) -> None:
        if not self.live:
            return
        if self.saved is None:
            self.saved = self._copies()
            if self.saved is None:
                return
        torch._foreach_copy_(self.saved, self.live)

    def restore(self) -> None:
        if self.saved:
            torch._foreach_copy_(self.live, self.saved)
