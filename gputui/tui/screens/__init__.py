"""Screens over the main one: help, OOM dialog, top tensors, the what-if planner, memory readings,
the script's log, quit confirmation, and the failure report, a module each.

Each is given what it shows (the RunView, the script's output) and asks the app for anything else
with a message (messages.py): none knows the app.
"""

from .base import Overlay
from .dialogs import ConfirmQuit, FailureScreen
from .help import HelpScreen
from .log import LogScreen
from .memory import MemoryScreen
from .oom import OomScreen
from .planner import PlannerScreen
from .tensors import TopTensorsScreen

__all__ = [
    "ConfirmQuit",
    "FailureScreen",
    "HelpScreen",
    "LogScreen",
    "MemoryScreen",
    "OomScreen",
    "Overlay",
    "PlannerScreen",
    "TopTensorsScreen",
]
