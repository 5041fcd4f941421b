"""Loss values in what a training script prints, for scripts that run their own loop.

Handles the formats people print: tqdm postfixes (`loss=0.693`), Lightning progress bars
(`train_loss=0.693`), Hugging Face Trainer dicts (`{'loss': 0.693, ...}`), and plain lines
(`step 42 loss: 0.693`, `iter 42: loss 0.693`, `epoch 3 ... loss 0.69`). Transformers 5 quotes
the values (`{'loss': '0.693', ...}`). Validation and test losses are not training losses and are
skipped, and so is a plain line that reports one next to the training loss (nanoGPT's `step 0:
train loss 4.87, val loss 4.87`): it is an evaluation report, whose training loss is an average
over many batches, not the step's. A progress bar is still read: Lightning's shows the last
`val_loss` beside the live `train_loss`.
"""

from __future__ import annotations

import re
from collections.abc import Callable

_NUMBER = r"([-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?|nan|inf)"
_LOSS = re.compile(r"""(?<![\w.])((?:[a-z]+[_/ ])?)loss['"]?\s*(?:[:=]\s*|\s+)['"]?""" + _NUMBER, re.IGNORECASE)
_NOT_TRAINING = ("val", "valid", "validation", "eval", "test", "dev")


def loss_in(line: str) -> tuple[float, str] | None:
    """The training loss a line reports and the style it was printed in, or None."""
    training, evaluation = None, False
    for match in _LOSS.finditer(line):
        prefix = match.group(1).strip(" _/").lower()
        if prefix in _NOT_TRAINING:
            evaluation = True
        elif training is None and prefix in ("", "train"):
            training = float(match.group(2))
    if training is None:
        return None
    style = _style(line)
    if evaluation and style == "printed":  # not a progress bar: an evaluation report
        return None
    return training, style


def _style(line: str) -> str:
    if line.lstrip().startswith("{") and "'loss'" in line:
        return "printed (Hugging Face Trainer)"
    if "v_num" in line or re.search(r"Epoch \d+:\s+\d+%\|", line):
        return "printed (Lightning)"
    if re.search(r"\d+%\|", line) or "it/s" in line or "s/it" in line:
        return "printed (tqdm)"
    return "printed"


class LossParser:
    """Fed the script's output in pieces; calls `found(value, style)` for each loss it reads.

    Progress bars redraw with carriage returns, so a line ends at "\\r" as well as "\\n"."""

    def __init__(self, found: Callable[[float, str], None]) -> None:
        self.found = found
        self._partial = ""

    def feed(self, text: str) -> None:
        parts = re.split(r"[\r\n]", self._partial + text)
        self._partial = parts.pop()[-4096:]
        for line in parts:
            hit = loss_in(line)
            if hit is not None:
                self.found(*hit)
