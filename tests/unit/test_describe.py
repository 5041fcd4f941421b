"""Every event the engine can emit has its own line: none falls back to its bare name."""

import pytest

from gputui.telemetry.describe import describe
from gputui.telemetry.events import EVENTS, check_event
from gputui.telemetry.sample import Event

ROW = {"count": 2, "shape": [64, 32], "dtype": "float32", "bytes": 16384, "role": "parameter"}
EXAMPLES = {
    "oom_recovered": {"phase": "backward", "micro_batch": 8, "micro_batch_to": 4, "accumulation": 2, "batch_size": 8},
    "oom": {"phase": "forward", "micro_batch": 1, "recovered": False},
    "rank_oom_recovered": {"rank": 1, "ooms": 1, "micro_batch": 4},
    "rank_waiting": {"ranks": [1], "at": 4, "waited_s": 61},
    "micro_batch_changed": {"from": 8, "to": 4, "accumulation": 2},
    "amp_changed": {"from": "off", "to": "bf16"},
    "checkpointing_changed": {"enabled": True, "how": "3 Block modules"},
    "auto_recover_changed": {"enabled": False},
    "cache_freed": {"bytes": 2**20, "reserved_before": 2**21, "reserved_after": 2**20},
    "memory_limit": {"limit": 2**30, "reserved": 3 * 2**30},
    "paused": {},
    "resumed": {},
    "stopped": {"reason": "requested"},
    "control_refused": {"action": "halve_batch", "reason": "the micro-batch is already 1"},
    "loss_not_finite": {"loss": "nan"},
    "step_skipped": {"at": 7, "skipped": 2},
    "batch_norm_micro_batched": {"layers": 2, "micro_batch": 4, "batch_size": 16},
    "items_hint": {
        "why": "its labels hold -100 (positions the loss ignores)",
        "fix": 'items=lambda batch: (batch["labels"] != -100).sum()',
        "micro_batch": 4,
    },
    "fused_hint": {"optimizer": "AdamW", "fix": "torch.optim.AdamW(..., fused=True)"},
    "thrashing": {"alloc_retries": 6, "steps": 3, "micro_batch": 8, "micro_batch_to": 4, "accumulation": 2},
    "snapshot_saved": {"path": "/tmp/s.pickle", "summary_path": "/tmp/s.txt", "reason": "requested"},
    "top_tensors": {"rows": [ROW], "total_bytes": 16384, "tensors": 2},
    "memory_summary": {"text": "|  PyTorch CUDA memory summary |"},
    "plan": {
        "trigger": "asked",
        "capacity": 2**30,
        "correction": 0,
        "tracked": False,
        "complete": True,
        "options": [
            {"remedy": "now", "label": "as now", "peak": 2**29},
            {"remedy": "best", "label": "24x3", "peak": 2**28},
        ],
    },
    "error": {"message": "out of memory inside optimizer.step()"},
    "run_continued": {"refused": {}, "total_steps": 200, "micro_batch": 4},
    "part_ended": {"by": "fit", "steps": 100, "samples": 3200},
    "eval": {
        "value": 2.4137,
        "batches": 12,
        "samples": 96,
        "items": 3456,
        "seconds": 1.23,
        "micro_batch": 4,
        "ooms": 1,
    },
    "sink_failed": {"message": "metrics file m.jsonl: No space left on device; no more lines will be written"},
    "signalled": {"reason": "terminated"},
    "script_ended": {"code": 3, "report": ["Traceback (most recent call last):", "ValueError: boom"]},
}


def test_every_event_has_an_example():
    assert set(EXAMPLES) == set(EVENTS)


@pytest.mark.parametrize("name", sorted(EVENTS))
def test_every_event_is_described_by_its_own_line(name):
    details = EXAMPLES[name]
    check_event(name, details)
    text = describe(Event(name, 3, details))
    assert text and "{" not in text
    if name not in ("paused", "resumed"):  # the two whose own line is their name
        assert text != name.replace("_", " ")


@pytest.mark.parametrize("name", sorted(EVENTS))
def test_the_details_an_event_promises_are_enough_to_describe_it(name):
    """What a peer must send: a line from the required details alone (no KeyError in the client's check)."""
    details = {key: EXAMPLES[name][key] for key in EVENTS[name]}
    text = describe(Event(name, 3, details))
    assert text and "{" not in text
    if name not in ("paused", "resumed"):
        assert text != name.replace("_", " ")


def test_a_plan_and_a_planned_recovery_say_what_was_chosen():
    assert (
        describe(Event("plan", 3, EXAMPLES["plan"])) == "plan (2 options); now 512 MiB of 1.00 GiB; best 24x3: 256 MiB"
    )
    picked = {**EXAMPLES["oom_recovered"], "micro_batch_to": 6, "reason": "predicted peak 7.00 GiB of 8.00 GiB at 6"}
    assert describe(Event("oom_recovered", 3, picked)).endswith(
        "retried as 6+2=8 (predicted peak 7.00 GiB of 8.00 GiB at 6)"  # an uneven cut as its pieces add up
    )
    halved = {**EXAMPLES["oom_recovered"], "reason": "halved"}
    assert describe(Event("oom_recovered", 3, halved)).endswith("retried as 4x2=8")


def test_an_own_loop_oom_diagnosis_is_described():
    details = {"diagnosis": True, "phase": "backward", "where": "train.py:12 in <module>", "recovered": False}
    assert describe(Event("oom", 0, details)) == "OOM in backward at train.py:12 in <module>: the script stopped"


def test_the_engine_cannot_emit_an_event_outside_the_set_or_without_its_details():
    with pytest.raises(ValueError, match="unknown event 'oom_recoverd'"):
        check_event("oom_recoverd", {})
    with pytest.raises(ValueError, match="without micro_batch_to, accumulation"):
        check_event("oom_recovered", {"phase": "forward", "micro_batch": 4})


def test_an_event_from_a_newer_peer_is_still_named():
    assert describe(Event("gradient_spike", 3, {})) == "gradient spike"
    assert describe(Event("stopped", 3, {})) == "stopped"  # a peer's event without its details
