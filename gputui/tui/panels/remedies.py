"""The remedies bar: the settings in force, each after its key, and what the planner predicts for them."""

from __future__ import annotations

from collections.abc import Hashable

from rich.console import RenderableType
from rich.text import Text

from ...telemetry.describe import number
from ...units import format_bytes, format_bytes_short, format_pieces
from ..availability import why_not
from ..keys import BY_ACTION, KEYS, Key, shown
from ..planned import pieces, predicted
from ..view import RunView
from .base import RunPanel, flow

FIT = tuple(
    BY_ACTION[action]
    for action in ("halve_batch", "double_batch", "cycle_amp", "toggle_checkpointing", "toggle_auto_recover")
)
"""The keys of the remedies fit applies, in the bar's order (halve and double share the micro-batch's entry)."""
HALVE, DOUBLE, AMP, CHECKPOINTING, AUTO_RECOVER = FIT

OWN_LOOP = tuple(BY_ACTION[action] for action in ("free_cache", "snapshot", "top_tensors", "toggle_pause"))
"""The own-loop bar's keys: it has no micro-batch, AMP or checkpointing of gputui's to show (a key the
run refuses is dimmed, and says why when pressed)."""


class RemediesBar(RunPanel):
    """The remedies in force, each after its key (dimmed when it cannot act now), and beside it what
    the key would lead to where the planner predicted it for the settings in force (`b 16×4 7.20 GiB ✓`).
    The entries stay whole: shorter labels where they save a line, else a second line; a wide bar adds
    why the dimmed keys cannot act (narrower ones say it when the key is pressed)."""

    def __init__(self, view: RunView, watch_only: str | None, *, id: str | None = None) -> None:
        super().__init__(view, id=id)
        self.watch_only = watch_only

    def shows(self) -> Hashable:
        v = self.view
        batch = v.pieces
        dimmed = tuple(why_not(v, k.action, self.watch_only) for k in KEYS if k.control)
        return v.observed, batch, v.amp, v.checkpointing, v.auto_recover, len(v.pending), dimmed, v.plans

    def render(self) -> RenderableType:
        width = max(1, self.content_size.width)
        long, short = flow(self.entries(long=True), width), flow(self.entries(long=False), width)
        return Text("\n").join(short if len(short) < len(long) else long)

    def entries(self, *, long: bool) -> list[Text]:
        v, pieces_now = self.view, self.view.pieces

        def key(k: Key, label: str, style: str = "bold", keys: str | None = None) -> Text:
            dim = why_not(v, k.action, self.watch_only) is not None
            return (
                Text()
                .append(f"[{keys or shown(k)}]", style="dim" if dim else "bold reverse")
                .append(f" {label}", style=style)
            )

        wide = self.content_size.width >= 140
        if v.observed:
            entries = [Text("own loop, observed:", style="bold")]
            entries += [key(k, k.called(long), "") for k in OWN_LOOP]
            needs = " ".join(shown(k) for k in FIT if wide or k is not DOUBLE)  # narrower: a key a setting
            if wide:
                needs += f" (batch, {', '.join(k.called(True) for k in (AMP, CHECKPOINTING, AUTO_RECOVER))})"
            entries.append(Text(f"· {needs} need gputui.fit (README: Adopting fit)", style="dim"))
            actions = OWN_LOOP
        else:
            mb, batch = "micro-batch" if long else "mb", f"{shown(HALVE)}/{shown(DOUBLE)}"
            entries = [
                key(HALVE, f"{mb} {format_pieces(*pieces_now, spaced=True)}", keys=batch)
                if pieces_now
                else key(HALVE, f"{mb} –", "", keys=batch),
                *self.predictions((HALVE, DOUBLE), long),
                key(AMP, f"{AMP.called(long)} {v.amp or '–'}"),
                *self.predictions((AMP,), long),
                key(CHECKPOINTING, f"{CHECKPOINTING.called(long)} {on_off(v.checkpointing)}"),
                *self.predictions((CHECKPOINTING,), long),
                key(AUTO_RECOVER, f"{AUTO_RECOVER.called(long)} {on_off(v.auto_recover)}"),
            ]
            if v.pending:
                entries.append(Text(f"→ {len(v.pending)} pending", style="yellow"))
            actions = FIT
        if wide:  # why the dimmed keys cannot act, each reason once (narrower: when the key is pressed)
            reasons: dict[str, list[str]] = {}
            for k in actions:
                reason = why_not(v, k.action, self.watch_only)
                if reason:
                    reasons.setdefault(reason, []).append(shown(k))
            entries += [Text(f"· {' '.join(keys)}: {reason}", style="dim italic") for reason, keys in reasons.items()]
        return entries

    def predictions(self, keys: tuple[Key, ...], long: bool) -> list[Text]:
        """`b 16×4 7.20 GiB ✓` for each of the keys with a fresh prediction: the setting it switches
        to, the predicted step peak (`~`: estimated, not traced), whether it fits (no mark: the
        capacity is unknown)."""
        size = format_bytes if long else format_bytes_short
        entries = []
        for k in keys:
            o = predicted(self.view, k.key)  # the plan's row of the remedy this key applies
            if o is None:
                continue
            if k is AMP:
                setting = o.get("amp")
            elif k is CHECKPOINTING:
                setting = on_off(bool(o.get("checkpointing")))
            else:
                setting = pieces(o, compact=True)
            peak = number(o.get("peak"))
            text = Text().append(shown(k), style="bold")
            text.append(f" {setting} {'' if o.get('exact') else '~'}{'?' if peak is None else size(peak)}")
            if isinstance(o.get("fits"), bool):
                text.append(" ✓" if o["fits"] else " ✗", style="bold green" if o["fits"] else "bold red")
            entries.append(text)
        return entries


def on_off(flag: bool) -> str:
    return "on" if flag else "off"
