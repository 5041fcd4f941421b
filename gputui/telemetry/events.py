"""The closed set of events the engine emits, each with the details it always carries: what the progress
line, the timeline and `gputui ctl` describe (telemetry/describe.py), checked where an event is made."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

EVENTS: dict[str, tuple[str, ...]] = {
    "oom_recovered": ("phase", "micro_batch", "micro_batch_to", "accumulation", "batch_size"),
    "rank_oom_recovered": ("rank", "ooms", "micro_batch"),
    "rank_waiting": ("ranks", "at", "waited_s"),  # at: the step it waits in
    "oom": ("phase", "recovered"),
    "micro_batch_changed": ("from", "to", "accumulation"),
    "amp_changed": ("from", "to"),
    "checkpointing_changed": ("enabled", "how"),
    "auto_recover_changed": ("enabled",),
    "cache_freed": ("bytes",),
    "memory_limit": ("limit", "reserved"),
    "paused": (),
    "resumed": (),
    "stopped": ("reason",),
    "control_refused": ("action", "reason"),
    "loss_not_finite": ("loss",),
    "step_skipped": ("at", "skipped"),
    "batch_norm_micro_batched": ("layers", "micro_batch", "batch_size"),
    "items_hint": ("why", "fix", "micro_batch"),
    "fused_hint": ("optimizer", "fix"),
    "thrashing": ("alloc_retries", "steps", "micro_batch", "micro_batch_to", "accumulation"),
    "snapshot_saved": ("path", "summary_path", "reason"),
    "top_tensors": ("rows", "total_bytes", "tensors"),
    "memory_summary": ("text",),
    "plan": ("trigger", "options", "capacity", "correction", "tracked", "complete"),
    "error": ("message",),
    "run_continued": ("refused",),
    "part_ended": ("by", "steps", "samples"),
    "sink_failed": ("message",),
    # gputui.evaluate()'s result (between steps, at the step last published); value null if not finite.
    "eval": ("value", "batches", "samples", "items", "seconds", "micro_batch", "ooms"),
    # Not the engine's: `gputui run` tells its screen (tui/local.py), and no one else.
    "signalled": ("reason",),
    "script_ended": ("code",),
}
"""Every event the engine emits, with the details each always carries: the closed set that the
progress line, the timeline and `gputui ctl` can all describe (telemetry/describe.py)."""


def check_event(name: str, details: Mapping[str, Any]) -> None:
    """ValueError for an event outside the set, or one without a detail its readers need: a bug
    in the engine, caught where it is made rather than shown as a bare name."""
    required = EVENTS.get(name)
    if required is None:
        raise ValueError(f"unknown event {name!r}")
    missing = [key for key in required if key not in details]
    if missing:
        raise ValueError(f"event {name!r} without {', '.join(missing)}")
