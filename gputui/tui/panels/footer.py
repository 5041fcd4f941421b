"""The main screen's footer: Textual's, fitted to the width."""

from __future__ import annotations

from textual import events
from textual.app import ComposeResult
from textual.widgets import Footer
from textual.widgets._footer import FooterKey  # the footer's key widget: textual.widgets does not export it


class KeysFooter(Footer):
    """Textual's footer, fitted to the width as the header is: compact when the keys do not fit
    with room around them, then the keys that cannot act now go (dimmed: a snapshot on a CPU), then the
    rest in DROP_ORDER (the remedies bar shows the first five with their keys already; w, the planner,
    stays longest after pause and tensors); `?` help and `q` quit always stay."""

    DROP_ORDER = (
        "double_batch",
        "toggle_auto_recover",
        "toggle_checkpointing",
        "cycle_amp",
        "halve_batch",
        "command_palette",
        "snapshot",
        "memory",
        "log",
        "free_cache",
        "plan",
        "toggle_pause",
        "top_tensors",
    )

    def compose(self) -> ComposeResult:
        hidden = self._fit()
        for widget in super().compose():
            if isinstance(widget, FooterKey):
                widget.display = _action(widget.action) not in hidden
            yield widget

    def on_resize(self, event: events.Resize) -> None:
        hidden = self._fit()
        for widget in self.query(FooterKey):
            widget.display = _action(widget.action) not in hidden

    def _fit(self) -> set[str]:
        """Set compact if needed; the actions whose keys do not fit even then."""
        width = self.size.width
        if not width or not self.is_attached:
            return set()
        keys, dimmed = {}, []
        for _, binding, enabled, _ in self.screen.active_bindings.values():
            if binding.show:
                keys[_action(binding.action)] = (len(self.app.get_key_display(binding)), len(binding.description))
                if not enabled:
                    dimmed.append(_action(binding.action))
        palette = self.screen.active_bindings.get(self.app.COMMAND_PALETTE_BINDING)
        if palette is not None and self.show_command_palette and self.app.ENABLE_COMMAND_PALETTE:
            # docked right, after a border: two cells more than a key
            keys["command_palette"] = (len(self.app.get_key_display(palette[1])), len(palette[1].description) + 2)
        # A key takes " k label " (compact: "k label" and a space after it).
        self.compact = sum(k + d + 3 for k, d in keys.values()) > width
        needed = sum(k + d + 2 for k, d in keys.values())
        hidden: set[str] = set()
        for action in [a for a in self.DROP_ORDER if a in dimmed] + list(self.DROP_ORDER):
            if needed <= width:
                break
            if action in keys and action not in hidden:
                hidden.add(action)
                needed -= sum(keys[action]) + 2
        return hidden


def _action(action: str) -> str:
    """A binding's action without its namespace: "app.halve_batch" -> "halve_batch"."""
    return action.rpartition(".")[2]
