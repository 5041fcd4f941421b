"""The main screen's keys: one table for the footer, the remedies bar, the help screen, the palette, the
view's checks and the planner's rows (named by remedy: which key leads to each)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Key:
    key: str
    action: str
    label: str
    help: str
    control: str | None = None
    """The control it sends to the training loop (telemetry.controls.ACTIONS), so the run's `refused`
    says when it cannot act; None for the keys that only open a screen."""
    screen: bool = False
    """It opens a screen that shows what the run last sent even where the control cannot be sent
    (watch-only, refused, ended): the key always acts, and the screen says why it cannot ask."""
    name: str | None = None
    """The label in full, where a panel has the room (the remedies bar); None where the label is whole."""
    remedy: str | None = None
    """The remedy the planner names the row of what this key leads to (a `plan` option's `remedy`); None
    for a key the planner does not predict."""

    def called(self, long: bool) -> str:
        """Its label, in full if `long`."""
        return self.name if long and self.name else self.label


KEYS = (
    Key(
        "b",
        "halve_batch",
        "halve",
        "Halve the micro-batch: accumulation doubles, the global batch, sampler and LR schedule stay as they are.",
        "halve_batch",
        remedy="halve",
    ),
    Key(
        "B",
        "double_batch",
        "double",
        "Double the micro-batch (up to the global batch): faster, more memory.",
        "double_batch",
        remedy="double",
    ),
    Key(
        "a",
        "cycle_amp",
        "AMP",
        "Cycle mixed precision: off -> bf16 -> fp16 (with a GradScaler) -> off.",
        "set_amp",
        remedy="amp",
    ),
    Key(
        "c",
        "toggle_checkpointing",
        "ckpt",
        "Activation checkpointing on the model's repeated blocks (a Hugging Face model's own switch): "
        "recompute activations in backward instead of keeping them (less memory, ~30% more compute).",
        "set_checkpointing",
        name="checkpointing",
        remedy="checkpointing",
    ),
    Key(
        "f",
        "free_cache",
        "free",
        "gc.collect() + torch.cuda.empty_cache(): return cached blocks to the "
        "device (helps other processes; adds no capacity to this one).",
        "free_cache",
        name="free cache",
    ),
    Key(
        "o",
        "toggle_auto_recover",
        "auto",
        "Auto-recover: on OOM halve the micro-batch and retry the same batch; off: pause and ask.",
        "set_auto_recover",
        name="auto-recover",
    ),
    Key(
        "w",
        "plan",
        "plan",
        "What-if planner: the predicted step peak of each remedy (b, B, a, c and the best fit) before it is "
        "pressed, against the capacity, traced from the run's model at the next step boundary.",
        "plan",
        screen=True,
    ),
    Key("p", "toggle_pause", "pause", "Pause after the current step / resume.", "pause"),
    Key(
        "s",
        "snapshot",
        "snap",
        "CUDA memory snapshot: a pickle for pytorch.org/memory_viz and memory_summary() as text.",
        "snapshot",
        name="snapshot",
    ),
    Key(
        "t",
        "top_tensors",
        "tensors",
        "The live tensors grouped by shape, dtype and role, largest first.",
        "top_tensors",
        name="top tensors",
    ),
    Key("m", "memory", "memory", "Every memory reading, with what each one means."),
    Key("l", "log", "log", "The script's own output (stdout and stderr)."),
    Key("question_mark", "help", "help", "This help."),
    Key("q", "quit", "quit", "Quit: asks first while training, then stops after the current step."),
)

BY_ACTION = {k.action: k for k in KEYS}
BY_KEY = {k.key: k for k in KEYS}
BY_REMEDY = {k.remedy: k for k in KEYS if k.remedy is not None}


def shown(key: Key) -> str:
    """The key as the user types it ("?" rather than Textual's "question_mark")."""
    return "?" if key.key == "question_mark" else key.key


def for_remedy(remedy: object) -> str:
    """The key that leads to a plan row's remedy, as the user types it; "" where none does (the setting
    in force, the best fit, a remedy this version does not know)."""
    key = BY_REMEDY.get(remedy) if isinstance(remedy, str) else None
    return shown(key) if key is not None else ""
