"""Whether a key can act now, and if not the one line that says why: read from the view (the run's
state and its announced refusals) and from the source (watch-only). The footer, the remedies bar, the
palette, the planner and the OOM dialog all ask here, so a dimmed key and its reason never disagree."""

from __future__ import annotations

from ..telemetry.controls import BATCH_NORM_FLOOR, CHANGES
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


def halved(view: RunView, micro: int) -> int:
    """`micro` halved as the job's rule does it (step/sizing.py, past the boundary the screen cannot
    import): never below the run's floor, nor below 1."""
    return max(micro // 2, view.info.min_micro_batch if view.info else 1, 1)


def micro_batch_once_applied(view: RunView) -> int | None:
    """The micro-batch once the halvings and doublings this screen asked for are applied (as the job's
    halving rule would make it), so a key pressed again before the answer counts on from them."""
    micro, s = view.micro_batch, view.latest
    if micro is None or s is None:
        return None
    for action, _ in view.pending.asked.values():
        if action == "halve_batch":
            micro = halved(view, micro)
        elif action == "double_batch":
            micro = min(micro * 2, s.batch_size)
    return micro


def why_not(view: RunView, action: str, watch_only: str | None) -> str | None:
    """None if the key can act now, else the one-line reason shown when it is pressed."""
    key = BY_ACTION.get(action)
    if key is None or key.control is None or key.screen:
        return None
    reason = cannot_send(view, key.control, watch_only)
    if reason or view.info is None:  # the run not started has a reason
        return reason
    if view.stopping and key.control in CHANGES:
        return "the run is stopping after this step"
    micro, s = micro_batch_once_applied(view) if action in ("halve_batch", "double_batch") else None, view.latest
    if micro is None or s is None:  # not a batch key, or no step yet
        return None
    asked = any(a in ("halve_batch", "double_batch") for a, _ in view.pending.asked.values())  # reached once applied
    if action == "halve_batch" and micro <= 1:
        return f"the micro-batch {'will already be' if asked else 'is already'} 1"
    if action == "halve_batch" and micro <= view.info.min_micro_batch:
        return BATCH_NORM_FLOOR
    if action == "double_batch" and micro >= s.batch_size:
        equals = "will already equal" if asked else "already equals"
        return f"the micro-batch {equals} the global batch ({s.batch_size})"
    return None
