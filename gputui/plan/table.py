"""The planner's table: the remedies that apply to the setting in force, the setting each would run,
and each row as the `plan` event carries it, named by its remedy (the screen maps a name to its key)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..step.sizing import Sizing
from ..telemetry.controls import AMP_MODES
from ..units import format_pieces
from .prediction import Prediction


@dataclass(frozen=True)
class Setting:
    micro_batch: int
    amp: str
    checkpointing: bool


@dataclass(frozen=True)
class Row:
    """One option of the table: a remedy and the setting it would run. The remedies: "now" (the setting in
    force), "halve", "double", "amp", "checkpointing" (fit's controls), "best" (the best fit)."""

    remedy: str
    setting: Setting


@dataclass(frozen=True)
class Remedies:
    """What a run can switch: the micro-batch by its Sizing, the AMP modes its device runs, checkpointing
    where it has blocks to checkpoint (`checkpointing_unavailable`: why not)."""

    sizing: Sizing
    amp_unsupported: Callable[[str], str | None]
    checkpointing_unavailable: str | None

    def rows(self, now: Setting, total: int) -> list[Row]:
        """The remedies that apply to `now`: the setting itself, each control's, and the best fit (its
        setting found when the table is made)."""
        mb, sizing = now.micro_batch, self.sizing
        rows = [Row("now", now)]
        if sizing.can_halve(mb):
            rows.append(Row("halve", Setting(sizing.halved(mb), now.amp, now.checkpointing)))
        if mb < total:
            rows.append(Row("double", Setting(sizing.doubled(mb, total), now.amp, now.checkpointing)))
        for mode in AMP_MODES:
            if mode != now.amp and self.amp_unsupported(mode) is None:
                rows.append(Row("amp", Setting(mb, mode, now.checkpointing)))
        if self.checkpointing_unavailable is None:
            rows.append(Row("checkpointing", Setting(mb, now.amp, not now.checkpointing)))
        rows.append(Row("best", now))
        return rows

    def fallbacks(self, now: Setting) -> list[tuple[str, bool]]:
        """The (AMP, checkpointing) pairs the best fit tries in turn: as now; with checkpointing; then
        with the first AMP mode the device runs, without and with checkpointing."""
        checkpointing = dict.fromkeys([now.checkpointing] + ([True] if self.checkpointing_unavailable is None else []))
        modes = [now.amp] + [m for m in ("bf16", "fp16") if m != now.amp and self.amp_unsupported(m) is None][:1]
        return [(amp, ck) for amp in modes for ck in checkpointing]


def option(
    row: Row, prediction: Prediction, *, peak: int, predicted: int, fits: bool | None, accumulation: int, total: int
) -> dict[str, Any]:
    """A row as the `plan` event carries it: `peak` corrected by what the run measured, `predicted` as traced."""
    s = row.setting
    return {
        "remedy": row.remedy,
        "label": label(row.remedy, s, accumulation, total),
        "micro_batch": s.micro_batch,
        "accumulation": accumulation,
        "batch_size": total,
        "amp": s.amp,
        "checkpointing": s.checkpointing,
        "peak": peak,
        "predicted": predicted,
        "phase": prediction.phase,
        "exact": prediction.exact,
        "reason": prediction.reason,
        "fits": fits,
        "seconds": round(prediction.seconds, 3),
        "breakdown": dict(prediction.breakdown),
    }


def label(remedy: str, s: Setting, accumulation: int, total: int) -> str:
    settings = format_pieces(s.micro_batch, accumulation, total, sums=False)
    if remedy in ("halve", "double"):
        return f"micro-batch {settings}"
    if remedy == "amp":
        return f"AMP {s.amp}"
    if remedy == "checkpointing":
        return f"checkpointing {'on' if s.checkpointing else 'off'}"
    extras = [x for x in (s.amp if s.amp != "off" else "", "ckpt" if s.checkpointing else "") if x]
    return " ".join([settings, *extras]) if remedy == "best" else "as now"
