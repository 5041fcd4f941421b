"""Whether a key can act now, and if not the one line that says why: read from the view (the run's
state and its announced refusals) and from the source (watch-only). The footer, the remedies bar, the
palette, the planner and the OOM dialog all ask here, so a dimmed key and its reason never disagree."""

from __future__ import annotations

from ..telemetry.controls import BATCH_NORM_FLOOR
from .keys import BY_ACTION
from .view import RunView


def cannot_send(view: RunView, control: str, watch_only: str | None) -> str | None:
    """None if the run can take the control now, else why not."""
    if watch_only:
        return watch_only
    if view.info is None:
        return "training has not started yet"
    if not view.training:
        return "training has ended"
    return view.refused.get(control)


def why_not(view: RunView, action: str, watch_only: str | None) -> str | None:
    """None if the key can act now, else the one-line reason shown when it is pressed."""
    key = BY_ACTION.get(action)
    if key is None or key.control is None or key.screen:
        return None
    reason = cannot_send(view, key.control, watch_only)
    if reason or view.info is None:  # the run not started has a reason
        return reason
    s = view.latest
    if action == "halve_batch" and s is not None and s.micro_batch <= 1:
        return "the micro-batch is already 1"
    if action == "halve_batch" and s is not None and s.micro_batch <= view.info.min_micro_batch:
        return BATCH_NORM_FLOOR
    if action == "double_batch" and s is not None and s.micro_batch >= s.batch_size:
        return f"the micro-batch already equals the global batch ({s.batch_size})"
    return None
