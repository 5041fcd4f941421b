"""One run's predictions: each traced once per (setting, batch shapes, optimizer state made), estimated
from the last measured step where a step cannot be traced, and corrected by what the run measured; the
largest micro-batch predicted to fit, found in a few of them."""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterable
from typing import Any

import torch
from torch import nn

from ..probes.cpu import state_tensors
from . import trace
from .blocks import rounding
from .counter import storage_bytes
from .prediction import Prediction, Unsafe, Untraceable, estimate, line
from .table import Setting

PICK_TRACES = 8
"""At most this many predictions to find the largest micro-batch that fits (it is found in 3-4)."""


class Later(Exception):
    """The tracing time is spent: the rest of a table waits for the next boundary; a search says the
    largest micro-batch it had found to fit by then (`fits`), if any."""

    def __init__(self, fits: int | None = None) -> None:
        super().__init__(fits)
        self.fits = fits


class NoPrediction(Exception):
    """Nothing to predict with: the step cannot be traced and no step has been measured to estimate from."""


class Predictions:
    """The predictions of one run's step. `fit_at`: the share of a capacity a peak fits below. `turned_off`
    is told why once a trace left what cannot be taken back: no step is traced after it. `deadline`: while
    set, a prediction not made by then raises Later, and so does a trace past the first since it was set that
    the last trace's time says would end after it (one trace of a large model can take longer than a
    boundary's share: then a boundary holds the step for one trace, not for several)."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        step: Callable[[nn.Module, Any], torch.Tensor],
        device: torch.device,
        *,
        tracked: bool,
        fit_at: float,
        checkpoint_modules: Any,
        blocks: int,
        floor: int,
        turned_off: Callable[[str], None],
    ) -> None:
        self.model, self.optimizer, self.step, self.device = model, optimizer, step, device
        self.tracked, self.fit_at = tracked, fit_at
        self.checkpoint_modules, self.blocks, self.floor = checkpoint_modules, blocks, floor
        self.turned_off = turned_off
        self.off: str | None = None  # why planning stopped for this run
        self.correction = 0
        self.measured: int | None = None
        self._deadline: float | None = None
        self._traced = 0  # traces since the deadline was set
        self._trace_s = 0.0  # how long the last trace took
        self._cache: dict[tuple[Setting, Hashable, int], Prediction] = {}
        self._untraceable: dict[tuple[str, bool], str] = {}  # (amp, checkpointing) whose step cannot be traced
        self._breakdown: dict[str, int] | None = None  # a measured step's, for estimates
        self._measured_setting: Setting | None = None
        self._entries = len(optimizer.state)  # the optimizer's state entries at the last measured step
        self._blocks = rounding(device)
        self._params: tuple[int, int] | None = None  # the parameters' bytes, the trainable ones'
        self._state = (-1, 0)  # the optimizer's state: (entries, bytes) when last counted
        if device.type == "cuda":  # until a step is measured: what a trace cannot see is already held
            self.correction = outside(model, optimizer, device)

    def state_dict(self, cache: bool = False) -> dict[str, Any]:
        """What this run learnt of its step, as plain data (a checkpoint loads it with weights_only): the
        calibration, and with `cache` (another run in this process, on the same model) the predictions."""
        m = self._measured_setting
        state: dict[str, Any] = {
            "correction": self.correction,
            "measured": self.measured,
            "breakdown": dict(self._breakdown) if self._breakdown is not None else None,
            "measured_setting": [m.micro_batch, m.amp, m.checkpointing] if m is not None else None,
            "untraceable": [[amp, ck, why] for (amp, ck), why in self._untraceable.items()],
            "off": self.off,
        }
        if cache:
            state["cache"] = dict(self._cache)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.correction = int(state.get("correction") or self.correction)  # none measured: what is held (CUDA)
        self.measured = state.get("measured")
        breakdown = state.get("breakdown")
        self._breakdown = dict(breakdown) if breakdown is not None else None
        m = state.get("measured_setting")
        self._measured_setting = Setting(int(m[0]), str(m[1]), bool(m[2])) if m is not None else None
        self._untraceable.update({(str(amp), bool(ck)): str(why) for amp, ck, why in state.get("untraceable") or ()})
        self.off = self.off or state.get("off")
        self._cache.update(state.get("cache") or {})

    def get(self, setting: Setting, batch: Any, shapes: Hashable) -> Prediction | None:
        """The cached or new prediction for `setting` on a batch of `shapes`; None when the step cannot
        be traced and no step has been measured yet to estimate from."""
        key = self.key(setting, shapes)
        found = self._cache.get(key)
        if found is not None:
            return found
        deadline = self._deadline
        if deadline is not None and time.monotonic() + (self._trace_s if self._traced else 0.0) > deadline:
            raise Later
        prediction = None
        mode = (setting.amp, setting.checkpointing)  # a step may trace as one and not as another
        if mode not in self._untraceable and self.off is None:
            started = time.monotonic()
            try:
                prediction = trace.predict(
                    self.model,
                    self.optimizer,
                    batch,
                    self.step,
                    micro_batch=setting.micro_batch,
                    amp=setting.amp,
                    checkpointing=setting.checkpointing,
                    device=self.device,
                    checkpoint_modules=self.checkpoint_modules,
                    min_micro_batch=self.floor,
                )
            except Untraceable as exc:
                self._untraceable[mode] = str(exc)
            except Unsafe as exc:  # another trace would leave the same
                self.off = f"planning is off for this run: {exc}"
                self.turned_off(self.off)
            except Exception as exc:  # the model's code on fake tensors: whatever it raises, training goes on
                self._untraceable[mode] = f"the step cannot be traced ({line(exc)})"
            self._trace_s, self._traced = time.monotonic() - started, self._traced + 1
        if prediction is None:
            if self._breakdown is None or self._measured_setting is None:
                return None
            m = self._measured_setting
            prediction = estimate(
                self._breakdown,
                m.micro_batch,
                m.amp,
                m.checkpointing,
                micro_batch=setting.micro_batch,
                amp=setting.amp,
                checkpointing=setting.checkpointing,
                blocks=self.blocks,
                reason=self._untraceable.get(mode, "not traced"),
            )
        self._cache[key] = prediction
        return prediction

    @property
    def deadline(self) -> float | None:
        return self._deadline

    @deadline.setter
    def deadline(self, at: float | None) -> None:
        self._deadline, self._traced = at, 0

    def held_state(self) -> dict[str, int]:
        """Parameters, their gradients and the optimizer's state as the device's allocator holds them, each
        storage once: what an estimate keeps fixed, for a reading with totals only (CUDA's allocator). The
        gradients are the trainable parameters' (all there at the peak). The parameters are counted once a
        run, the state again when its entries change."""
        if self._params is None:
            params = list(self.model.parameters())
            self._params = (self._bytes(params), self._bytes([p for p in params if p.requires_grad]))
        entries = len(self.optimizer.state)
        if entries != self._state[0]:
            self._state = (entries, self._bytes(state_tensors(self.optimizer)))
        return {"parameters": self._params[0], "gradients": self._params[1], "optimizer": self._state[1]}

    def _bytes(self, tensors: Iterable[torch.Tensor]) -> int:
        """Their storages on the device (not an optimizer's step counts kept on the host), as blocks; of a
        sharded tensor (FSDP2's DTensor), this rank's shard."""
        return _on_device(tensors, self.device, self._blocks)

    def untraceable(self, setting: Setting) -> str | None:
        """Why `setting`'s step cannot be traced, if it cannot."""
        return self._untraceable.get((setting.amp, setting.checkpointing))

    def key(self, setting: Setting, shapes: Hashable) -> tuple[Setting, Hashable, int]:
        """What a step's peak depends on: the setting, the batch's shapes, and whether the optimizer has
        made its state yet (before its first step the peak is where it makes it; after, it is held)."""
        return setting, shapes, len(self.optimizer.state)

    def peak(self, prediction: Prediction) -> int:
        """A prediction as the run would measure it: the peak it is checked against, corrected."""
        return prediction.bytes_for(self.tracked) + (self.correction if prediction.exact else 0)

    def fits(self, prediction: Prediction, capacity: int | None) -> bool | None:
        return None if capacity is None else self.peak(prediction) <= self.fit_at * capacity

    def measured_step(self, setting: Setting, shapes: Hashable, peak: int | None, breakdown: dict[str, int]) -> bool:
        """After each step: what estimates scale from, and the correction where this setting was traced
        (True then). Cheap when nothing was predicted for this setting."""
        entries = len(self.optimizer.state)
        if peak is None or entries != self._entries:  # the step that made the optimizer's state: not steady
            self._entries = entries
            return False
        self.measured, self._measured_setting, self._breakdown = peak, setting, breakdown
        predicted = self._cache.get(self.key(setting, shapes))
        if predicted is None or not predicted.exact:
            return False
        self.correction = peak - predicted.bytes_for(self.tracked)
        return True

    def learn(self, failed: Setting, batch: Any, shapes: Hashable, capacity: int) -> Prediction | None:
        """The prediction at a setting that ran out of memory; one that says it fits was low by at least what
        it missed capacity by, and the correction grows to say so."""
        p = self.get(failed, batch, shapes)
        if p is not None and p.exact and self.peak(p) <= capacity:
            self.correction = capacity - p.bytes_for(self.tracked) + 1
        return p

    def largest(self, amp: str, ck: bool, lo: int, hi: int, batch: Any, shapes: Hashable, capacity: int) -> int | None:
        """The largest micro-batch in [lo, hi] predicted to fit; None: not even `lo`. NoPrediction: none made.
        The peak grows about linearly with the micro-batch: the guess interpolates, then checks its neighbour."""

        def peak(m: int) -> int:
            p = self.get(Setting(m, amp, ck), batch, shapes)
            if p is None:
                raise NoPrediction
            return self.peak(p)

        limit = self.fit_at * capacity
        p_hi = peak(hi)
        if p_hi <= limit:
            return hi
        p_lo = peak(lo)
        if p_lo > limit:
            return None
        try:
            for _ in range(PICK_TRACES):
                if hi - lo <= 1:
                    break
                guess = lo + int((limit - p_lo) * (hi - lo) / max(p_hi - p_lo, 1))
                guess = min(max(guess, lo + 1), hi - 1)
                p = peak(guess)
                if p <= limit:
                    lo, p_lo = guess, p
                else:
                    hi, p_hi = guess, p
        except Later:
            raise Later(lo) from None
        return lo


def outside(model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device) -> int:
    """What CUDA's allocator holds beyond the training state (parameters, their gradients, the optimizer's
    state): the cuBLAS workspaces (one per thread that has run a matmul, 32 MiB each on an H200), tensors
    the script keeps (an EMA copy, a second model), DDP's buckets. A trace sees none of it; it is the
    correction until a measured step's replaces it."""
    params = list(model.parameters())
    state = params + [p.grad for p in params if p.grad is not None] + state_tensors(optimizer)
    return max(0, torch.cuda.memory_allocated(device) - _on_device(state, device, rounding(device)))


def _on_device(tensors: Iterable[torch.Tensor], device: torch.device, blocks: Callable[[int], int]) -> int:
    """Their storages on `device`'s kind, each once, as its allocator counts them (`blocks`)."""
    here = [_local(t) for t in tensors if t.device.type == device.type]
    return sum(map(blocks, storage_bytes(here).values()))


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a sharded tensor (FSDP2's DTensor), else the tensor."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t
