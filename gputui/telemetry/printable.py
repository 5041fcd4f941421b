"""Text that may reach a terminal, made inert: no escape sequence, no control byte survives.

A script's output (colours, progress bars, titles) and a job's strings on the socket (a fake or
broken job must not drive the user's terminal) both pass through here before they are shown.
"""

from __future__ import annotations

import re

_ESCAPES = re.compile(
    r"(?:\x1b\[|\x9b)[0-?]*[ -/]*[@-~]"  # CSI: colours, cursor moves, erase line
    r"|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?"  # OSC: titles, hyperlinks
    r"|\x1b[@-Z\\-_]"  # other two-byte escapes
    r"|[\x00-\x08\x0b-\x1f\x7f-\x9f]"  # every other control but tab and newline
    "|[\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]"
)  # bidi overrides: text shown reversed


def printable(text: str) -> str:
    """`text` without escape sequences, control characters (tab and newline kept) and bidi overrides."""
    return _ESCAPES.sub("", text)
