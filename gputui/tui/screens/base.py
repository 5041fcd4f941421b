"""Overlay: a full screen over the main one, left with escape."""

from __future__ import annotations

from textual.binding import Binding
from textual.screen import Screen


class Overlay(Screen[None]):
    """A full screen the user leaves with escape (or its own key again)."""

    BINDINGS = [Binding("escape", "dismiss", "back"), Binding("q", "dismiss", "back", show=False)]

    def action_dismiss(self) -> None:  # type: ignore[override]
        self.dismiss()

    def on_mount(self) -> None:
        self.call_after_refresh(self._first_update)  # is_mounted only turns true after on_mount

    def _first_update(self) -> None:
        """Not if the app closed meanwhile (a test's end, a quit): its widgets are being taken apart."""
        if self.app.is_running:
            self.update()

    def update(self) -> None:
        """Called by the app after each pull while this screen is on top."""
