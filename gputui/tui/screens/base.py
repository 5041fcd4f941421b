"""Overlay: a full screen over the main one, left with escape."""

from __future__ import annotations

from textual.binding import Binding
from textual.screen import Screen


class Overlay(Screen[None]):
    """A full screen the user leaves with escape (or its own key again)."""

    BINDINGS = [Binding("escape", "dismiss", "back"), Binding("q", "dismiss", "back", show=False)]

    def action_dismiss(self) -> None:  # type: ignore[override]
        self.dismiss()

    def update(self) -> None:
        """Called by the app after each pull while this screen is on top."""
