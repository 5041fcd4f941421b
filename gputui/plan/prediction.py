"""What a prediction is: one step's peak under one setting, what was alive then, and why there may be
none (Untraceable: the step cannot run on fake tensors; Unsafe: a trace left what cannot be taken
back). estimate() is the fallback where a step cannot be traced: a measured step, scaled."""

from __future__ import annotations

from dataclasses import dataclass

PARTS = ("parameters", "gradients", "optimizer", "activations", "temporaries")


@dataclass(frozen=True)
class Prediction:
    """One step's predicted peak under one setting.

    `peak`: bytes of every storage on the device alive at once at the step's worst moment, each counted as
    the device's allocator counts it (on CUDA the caching allocator's block, blocks.py: compare with
    `max_memory_allocated`, less what the script holds outside the step). `tracked_peak`: the same step as
    gputui's CPU tracker counts it (parameters, gradients, optimizer state and the activations saved for
    backward; no temporaries), which is what a CPU memory budget is checked against.
    `breakdown`: what was alive at `peak`, by PARTS.
    """

    peak: int
    tracked_peak: int
    phase: str
    breakdown: dict[str, int]
    micro_batch: int
    amp: str
    checkpointing: bool
    exact: bool
    reason: str | None = None
    seconds: float = 0.0

    def bytes_for(self, tracked: bool) -> int:
        """The peak a run compares with its capacity: the tracker's count under a CPU budget."""
        return self.tracked_peak if tracked else self.peak


class Untraceable(Exception):
    """The step cannot run on fake tensors; the message says why, in a line."""


class Unsafe(Exception):
    """The trace left a tensor in the script's objects where it cannot be taken out; the message says where."""


def estimate(
    measured: dict[str, int],
    measured_micro_batch: int,
    measured_amp: str,
    measured_checkpointing: bool,
    *,
    micro_batch: int,
    amp: str,
    checkpointing: bool,
    blocks: int,
    reason: str,
) -> Prediction:
    """The fallback: a measured step's breakdown (PARTS; peak = their sum) scaled to other settings.

    Activations and temporaries scale with the micro-batch, halve under AMP and, with checkpointing,
    keep about one block's worth in `blocks`. Parameters, gradients and optimizer state stay. Rough by
    design (off by up to half in the study), and labelled so with `reason`.
    """
    scale = micro_batch / max(measured_micro_batch, 1)
    scale *= _amp_factor(amp) / _amp_factor(measured_amp)
    if checkpointing != measured_checkpointing and blocks > 1:
        scale *= (1 / blocks) if checkpointing else blocks
    fixed = sum(measured.get(k, 0) for k in ("parameters", "gradients", "optimizer"))
    moving = {k: int(measured.get(k, 0) * scale) for k in ("activations", "temporaries")}
    parts = {k: measured.get(k, 0) for k in ("parameters", "gradients", "optimizer")} | moving
    peak = fixed + sum(moving.values())
    return Prediction(
        peak=peak,
        tracked_peak=fixed + moving["activations"],
        phase="backward",
        breakdown=parts,
        micro_batch=micro_batch,
        amp=amp,
        checkpointing=checkpointing,
        exact=False,
        reason=reason,
    )


def _amp_factor(mode: str) -> float:
    return 1.0 if mode == "off" else 0.5


def line(exc: BaseException) -> str:
    """An exception in one line: its type and the first line of its message."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
