"""The observer stands aside while gputui trains the script's steps itself (fit, a Trainer): fit counts
its own bytes (two trackers would count twice), and the observer's saved-tensor hooks come off the
training thread's stack, a Python call for each tensor autograd saves that cost the tiny MLP's 1.5 ms
step 75 us although it returns at once. They come back when fit returns: the script's own loop after
it is watched again."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from ..telemetry.run import RunInfo, RunSummary
from ..telemetry.sample import Event, StepRecord, StepSample


class Aside:
    """A hub sink for the observer (engine/observe.py): a fit run's start or continuation sends it aside,
    the end of that fit call (`part_ended`) or of the run brings it back."""

    def __init__(self, observer: Any) -> None:
        self.observer = observer
        self.thread: int | None = None  # the thread whose stack the hooks are off while fit runs
        # Given each step's record instead of its sample (fit's steps are not made samples for nothing), it
        # keeps none: a deque that holds nothing, its append a C call (no frame a step).
        self.on_record: Callable[[StepRecord], None] = deque[StepRecord](maxlen=0).append

    def on_start(self, info: RunInfo) -> None:
        if not info.observed:
            self.stand_aside()

    def on_sample(self, sample: StepSample) -> None:
        pass

    def on_event(self, event: Event) -> None:
        """A fit call or Trainer after the first continues the run (engine/continuity.py)."""
        if event.name == "run_continued":
            self.stand_aside()
        elif event.name == "part_ended":
            self.step_back_in()

    def on_end(self, summary: RunSummary) -> None:
        self.step_back_in()

    def stand_aside(self) -> None:
        o = self.observer
        o.fitting = True
        if o.session is not None:
            o.session.close_tracker()
        # fit runs in the script's thread, where the hooks are the innermost unless the script pushed
        # its own around fit.
        if o.hooks is not None and innermost_hooks() == o.hooks:
            torch._C._autograd._pop_saved_tensors_default_hooks()
            self.thread = threading.get_ident()

    def step_back_in(self) -> None:
        o = self.observer
        o.fitting = False
        if self.thread == threading.get_ident() and o.hooks is not None:
            torch._C._autograd._push_saved_tensors_default_hooks(*o.hooks)
            self.thread = None


def innermost_hooks() -> Any:
    """The thread's innermost saved-tensor hooks, or None where torch cannot say."""
    try:
        return torch._C._autograd._top_saved_tensors_default_hooks(True)
    except (AttributeError, TypeError):  # an older torch, without it or its argument
        return None
