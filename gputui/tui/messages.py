"""What screens ask of the app: they post these, the app acts (a screen never calls the app)."""

from __future__ import annotations

from typing import Any

from textual.message import Message


class RequestControl(Message):
    """Send a control to the training loop; `text` is how the timeline names the request."""

    def __init__(self, action: str, value: Any = None, *, text: str | None = None) -> None:
        super().__init__()
        self.action, self.value, self.text = action, value, text


class ShowScreen(Message):
    """Open the screen of a key's action ("log", "memory", "help", "top_tensors"), as the key would."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
