"""RunView on plain samples and events: what the screen shows, without Textual or torch."""

import pytest
from fakes import MiB, plan_option
from samples import step_sample

from gputui.telemetry.controls import BATCH_NORM_FLOOR
from gputui.telemetry.run import RunInfo, RunSummary
from gputui.telemetry.sample import Event, Memory, RankMemory
from gputui.tui.availability import micro_batch_once_applied, why_not
from gputui.tui.keys import KEYS
from gputui.tui.planned import fresh
from gputui.tui.sources import Update
from gputui.tui.view import RunView

OWN_LOOP = "the script runs its own loop: this needs gputui.fit (README: Adopting fit)"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def sample(step: int, *, loss: float | None = 1.0, micro: int = 8, batch: int = 8, rate: float | None = 80.0, ranks=()):
    memory = Memory("cpu", allocated=1000 * step, peak=2000 * step)
    return step_sample(
        step, loss=loss, batch_size=batch, micro_batch=micro, samples_per_s=rate, memory=memory, ranks=tuple(ranks)
    )


def update(*samples, events=(), info=None, summary=None, runs=1, **extra) -> Update:
    return Update(list(samples), list(events), info, summary, None, runs, **extra)


def view(info=None, *samples, events=()) -> RunView:
    v = RunView(clock=Clock(), script="train.py")
    v.apply(update(*samples, events=events, info=info or RunInfo(total_steps=100)))
    return v


def test_status_from_start_to_end():
    v = RunView(clock=Clock(), script="train.py")
    assert v.status == "starting" and not v.training
    v.apply(update(sample(1), info=RunInfo()))
    assert v.status == "training" and v.training
    v.apply(update(events=[Event("paused", 1, {})], info=v.info))
    assert v.status == "paused" and v.paused
    v.apply(update(events=[Event("resumed", 1, {})], info=v.info))
    assert v.status == "training"
    oom = Event("oom", 1, {"phase": "forward", "micro_batch": 8, "waiting": True, "recovered": False})
    v.apply(update(events=[oom], info=v.info))
    assert v.status == "OOM: waiting" and v.waiting_oom is oom and v.ooms == 1
    v.apply(update(events=[Event("resumed", 1, {})], info=v.info))
    assert v.status == "training" and v.waiting_oom is None
    v.stopping = True
    assert v.status == "stopping"
    v.apply(update(info=v.info, summary=RunSummary(steps=1, stopped="requested", elapsed_s=4.5)))
    assert v.status == "stopped" and not v.training and v.elapsed == 4.5


@pytest.mark.parametrize(
    "summary, code, failure, status",
    [
        (RunSummary(steps=3), 0, None, "finished"),
        (RunSummary(steps=3, error="ValueError: bad label"), 1, "Traceback...\nValueError: bad label", "failed"),
        (None, 1, "Traceback (most recent call last):\nNameError: name 'x' is not defined", "failed"),
        (None, 0, None, "finished"),  # a script that ended without fit's summary (its own loop)
    ],
)
def test_how_the_run_ended(summary, code, failure, status):
    v = view(None, sample(1))
    v.apply(update(info=v.info, summary=summary))
    v.script_ended(code, failure)
    assert v.status == status and not v.training
    lines = [e.text for e in v.timeline if e.kind == "error"]
    # The last line of a traceback joins the timeline, unless fit's own error event already said it.
    assert lines == (["NameError: name 'x' is not defined"] if summary is None and failure else [])


def test_a_banner_replaces_the_status():
    v = view(None, sample(1))
    v.apply(update(info=v.info, banner="disconnected: reconnecting…"))
    assert v.status == "disconnected: reconnecting…"
    v.apply(update(info=v.info))
    assert v.status == "training"


def test_why_not_says_why_a_key_cannot_act():
    v = RunView()
    assert why_not(v, "halve_batch", None) == "training has not started yet"
    assert why_not(v, "help", "watch-only") is None  # screens never need the loop
    v = view(RunInfo(min_micro_batch=2), sample(1, micro=4, batch=16))
    assert why_not(v, "halve_batch", "watch-only: attach with --control to steer") == (
        "watch-only: attach with --control to steer"
    )
    assert [k.action for k in KEYS if why_not(v, k.action, None)] == []
    v.apply(update(sample(2, micro=2, batch=16), info=v.info))
    assert why_not(v, "halve_batch", None) == BATCH_NORM_FLOOR  # the floor BatchNorm sets
    v.apply(update(sample(3, micro=16, batch=16), info=v.info))
    assert why_not(v, "double_batch", None) == "the micro-batch already equals the global batch (16)"
    v = view(RunInfo(), sample(1, micro=1, batch=16))
    assert why_not(v, "halve_batch", None) == "the micro-batch is already 1"
    v.stopping = True  # quit confirmed: no step would train with a change
    assert why_not(v, "double_batch", None) == why_not(v, "cycle_amp", None) == "the run is stopping after this step"
    assert why_not(v, "plan", None) is None  # its screen still shows the last plan
    assert why_not(v, "free_cache", None) is None  # the run still serves what changes no setting
    v.stopping = False
    v.requested(5, "memory snapshot", "snapshot")  # pending, but no halving: the micro-batch is 1 now
    assert why_not(v, "halve_batch", None) == "the micro-batch is already 1"
    v.apply(update(info=v.info, summary=RunSummary(steps=1)))
    assert why_not(v, "free_cache", None) == "training has ended"


def test_why_not_reads_the_refusals_the_run_announced():
    refused = dict.fromkeys(
        ("halve_batch", "double_batch", "set_amp", "set_checkpointing", "set_auto_recover"), OWN_LOOP
    )
    refused["snapshot"] = "memory snapshots are a CUDA allocator feature"
    v = view(RunInfo(mode="observe", refused=refused), sample(1))
    reasons = {k.action: why_not(v, k.action, None) for k in KEYS}
    assert v.observed
    assert reasons == {
        "halve_batch": OWN_LOOP,
        "double_batch": OWN_LOOP,
        "cycle_amp": OWN_LOOP,  # key actions map onto the run's control actions
        "toggle_checkpointing": OWN_LOOP,
        "toggle_auto_recover": OWN_LOOP,
        "plan": None,  # its screen opens whatever the run takes: it says why it cannot ask
        "free_cache": None,
        "toggle_pause": None,
        "snapshot": "memory snapshots are a CUDA allocator feature",
        "top_tensors": None,
        "memory": None,
        "log": None,
        "help": None,
        "quit": None,
    }
    paused = view(RunInfo(refused={"pause": "this run cannot pause"}), sample(1))
    assert why_not(paused, "toggle_pause", None) == "this run cannot pause"


def test_loss_series_and_throughput():
    v = view(RunInfo(total_steps=100), sample(1, loss=2.0), sample(2, loss=None), sample(3, loss=1.5, rate=40.0))
    assert v.series.loss.steps == [1, 3] and v.series.loss.values == [2.0, 1.5]  # a step without a loss: no point
    assert v.series.allocated.values == [1000, 2000, 3000]
    assert v.first.step == 1 and v.latest.step == 3 and v.samples_seen == 3
    assert v.eta == pytest.approx((100 - 3) * 8 / 40.0)  # steps left, at the latest rate
    v.apply(update(events=[Event("paused", 3, {})], info=v.info))
    assert v.eta is None  # no time left is counted while nothing trains
    v.apply(update(events=[Event("resumed", 3, {})], info=v.info))
    assert v.eta is not None
    v.apply(update(sample(4, rate=None), info=v.info))
    assert v.eta is None


def test_event_lines_of_the_timeline():
    v = view(None, sample(3))
    v.requested(7, "halve micro-batch (8 -> 4)")
    assert v.pending == {7: "halve micro-batch (8 -> 4)"}
    events = [
        Event("micro_batch_changed", 3, {"from": 8, "to": 4, "accumulation": 2, "request_id": 7, "latency_s": 0.012}),
        Event("control_refused", 3, {"action": "set_amp", "reason": "fp16 needs CUDA", "request_id": 8}),
        Event(
            "oom_recovered",
            4,
            {
                "phase": "backward",
                "micro_batch": 4,
                "micro_batch_to": 2,
                "accumulation": 4,
                "batch_size": 8,
                "message": "...",
            },
        ),
    ]
    v.apply(update(events=events, info=v.info))
    lines = [(e.kind, e.step, e.text) for e in v.timeline]
    assert not v.pending and v.entries == 4 and v.ooms == 1
    assert lines[3] == ("requested", 3, "→ requested: halve micro-batch (8 -> 4) · applies at the next step boundary")
    assert lines[2][0] == "applied" and lines[2][2].startswith("✓ micro-batch 8 -> 4 (accumulation 2) · ")
    assert lines[2][2].endswith("applied after step 3, 12 ms after the request")
    assert lines[1][0] == "refused" and "fp16 needs CUDA" in lines[1][2] and not lines[1][2].startswith("✓")
    assert lines[0][:2] == ("oom", 4)
    v.requested(9, "stop")  # answered by the run's end, which no event names
    v.apply(update(info=v.info, summary=RunSummary(steps=4, stopped="requested")))
    assert not v.pending


def test_a_reconnection_starts_the_view_over_with_the_jobs_history():
    v = view(None, sample(1), sample(2), events=[Event("paused", 2, {})])
    v.requested(3, "free cache")
    generation = v.generation
    history = {"loss": ([10, 20], [0.9, 0.8], 1)}
    v.apply(update(sample(21), info=RunInfo(pid=4242, argv=("/home/ada/train.py",)), reset=True, history=history))
    assert v.generation == generation + 1
    assert not v.timeline and not v.pending and not v.paused
    assert v.series.loss.steps == [10, 20, 21] and v.first.step == 21
    v.remote = True
    assert v.name == "train.py · pid 4242"


def test_new_samples_and_lines_move_the_counters_panels_compare():
    v = view(None, sample(1))
    before = (v.generation, v.samples_seen, v.entries)
    v.apply(update(info=v.info))  # nothing new
    assert (v.generation, v.samples_seen, v.entries) == before
    v.apply(update(sample(2), events=[Event("paused", 2, {})], info=v.info))
    assert (v.generation, v.samples_seen, v.entries) == (before[0], before[1] + 1, before[2] + 1)


RANK = RunInfo(rank=1, world_size=4, job="run7@node0:29500")


def ranks(*peaks, capacity=1000, micro=8):
    return [RankMemory(r, micro, peak, capacity) for r, peak in enumerate(peaks)]


def test_one_process_has_no_ranks_to_show():
    v = view(None, sample(1))
    assert v.job_ranks == () and v.ranks(5) is None
    assert RunView().ranks(5) is None  # before the first step


def test_every_rank_when_they_fit_the_worst_by_share_of_capacity():
    job = [RankMemory(0, 8, 500, 1000), RankMemory(1, 8, 700, 2000), RankMemory(2, 4, 600, 1000), RankMemory(3, 8)]
    v = view(RANK, sample(1, ranks=job))
    shown = v.ranks(5)
    assert shown.shown == tuple(job)  # rank order, the one without a peak yet included
    assert shown.worst == 2 and shown.this == 1  # 60%: the highest share, not the highest peak (rank 1's 35%)
    assert shown.hidden == 0 and shown.hidden_worst is None
    assert v.ranks(4) == shown  # exactly as many lines as ranks: no line for a note


def test_without_capacities_the_worst_is_the_highest_peak():
    v = view(RANK, sample(1, ranks=ranks(500, 300, 900, 100, capacity=None)))
    assert v.ranks(5).worst == 2
    first = view(RANK, sample(1, ranks=[RankMemory(r, 8) for r in range(4)]))  # the exchange is a step late
    assert first.ranks(5).worst is None and len(first.ranks(5).shown) == 4


def test_many_ranks_the_worst_few_and_this_one_and_how_many_are_left_out():
    peaks = [100 + (r * 37 % 64) * 10 for r in range(64)]  # rank 19 the worst (730), then 38 (720), 57, 12...
    v = view(RANK, sample(1, ranks=ranks(*peaks)))
    shown = v.ranks(5)  # four ranks and a line that says how many are not
    assert [r.rank for r in shown.shown] == [1, 19, 38, 57]  # the three worst and this one, in rank order
    assert shown.worst == 19 and shown.this == 1
    assert shown.hidden == 60 and shown.hidden_worst.rank == 12 and shown.hidden_worst.peak == 700
    this_is_worst = view(RunInfo(rank=19, world_size=64), sample(1, ranks=ranks(*peaks)))
    assert [r.rank for r in this_is_worst.ranks(3).shown] == [19, 38]  # already among the worst: no place taken
    assert this_is_worst.ranks(3).hidden == 62


def test_the_ranks_key_changes_only_with_what_is_shown():
    """The panel's shows() key: equal for equal ranks, hashable, different when a rank moves."""
    v = view(RANK, sample(1, ranks=ranks(500, 600)))
    before = v.ranks(5)
    v.apply(update(sample(2, ranks=ranks(500, 600)), info=v.info))
    assert v.ranks(5) == before and hash(v.ranks(5)) == hash(before)
    v.apply(update(sample(3, ranks=ranks(500, 610)), info=v.info))
    assert v.ranks(5) != before


def test_a_setting_changed_after_the_last_step_is_the_views_before_the_next_steps_record():
    """The change's event reaches the screen before the next step's record: the view says the new AMP and
    checkpointing from the event (a key pressed again counts on from it), the records again once a later
    step brings them."""
    v = view(None, sample(5))
    v.apply(update(events=[Event("amp_changed", 5, {"from": "off", "to": "bf16", "request_id": 1})], info=v.info))
    v.apply(update(events=[Event("checkpointing_changed", 5, {"enabled": True, "how": "4 x Block"})], info=v.info))
    assert v.amp == "bf16" and v.checkpointing and v.next_amp() == "fp16"
    v.apply(update(sample(6), info=v.info))  # a later record (this test's says off) is the truth again
    assert v.amp == "off" and not v.checkpointing


def test_the_batch_keys_count_on_from_the_halvings_and_doublings_asked_and_applied():
    """b pressed again before the job answers (or before the next step's record, after the change's
    event) counts from the micro-batch the first will make: the key is dimmed when the halvings asked
    already reach 1, and the timeline's text says each halving's own sizes."""
    v = view(RunInfo(), sample(1, micro=4, batch=16))
    v.requested(1, "halve", "halve_batch")
    assert micro_batch_once_applied(v) == 2 and why_not(v, "halve_batch", None) is None
    v.requested(2, "halve", "halve_batch")
    assert micro_batch_once_applied(v) == 1
    assert why_not(v, "halve_batch", None) == "the micro-batch will already be 1"
    changed = Event("micro_batch_changed", 1, {"from": 4, "to": 2, "accumulation": 8, "request_id": 1})
    v.apply(update(events=[changed], info=v.info))  # the first applied, before step 2's record
    assert v.micro_batch == 2 and micro_batch_once_applied(v) == 1
    v.apply(
        update(
            sample(2, micro=1, batch=16),
            events=[Event("micro_batch_changed", 1, {"from": 2, "to": 1, "accumulation": 16, "request_id": 2})],
            info=v.info,
        )
    )
    assert not v.pending and why_not(v, "halve_batch", None) == "the micro-batch is already 1"
    v.requested(3, "double", "double_batch")
    v.requested(4, "double", "double_batch")
    v.requested(5, "double", "double_batch")
    assert micro_batch_once_applied(v) == 8 and why_not(v, "double_batch", None) is None
    v.requested(6, "double", "double_batch")
    assert why_not(v, "double_batch", None) == "the micro-batch will already equal the global batch (16)"
    recovered = {"phase": "backward", "micro_batch": 1, "micro_batch_to": 1, "accumulation": 16, "batch_size": 16}
    v.apply(update(sample(3, micro=16, batch=16), info=v.info, summary=None))
    v.pending.clear()
    v.apply(
        update(events=[Event("oom_recovered", 3, {**recovered, "micro_batch": 16, "micro_batch_to": 8})], info=v.info)
    )
    assert v.micro_batch == 8 and why_not(v, "double_batch", None) is None  # an OOM's replay halved it


def test_a_batch_change_applied_while_no_step_runs_is_the_views_and_the_plans_made_for_it_are_fresh():
    """Paused (or waiting after an OOM), a change is applied and no step's record follows: the remedies bar,
    the keys and the planner's "stale" read the change's event, so a plan made for the new setting is fresh
    and one made for the old is stale, said with the pieces as they add up."""
    v = view(RunInfo(), sample(1, micro=32, batch=64))
    plan = Event("plan", 1, {"options": [plan_option("now", "as now", 16, "off", False, 10 * MiB, 80 * MiB)]})
    v.apply(update(events=[plan], info=v.info))
    assert v.pieces == (32, 2, 64) and not fresh(v)
    changed = Event("micro_batch_changed", 1, {"from": 32, "to": 16, "accumulation": 4})
    v.apply(update(events=[changed, Event("paused", 1, {})], info=v.info))
    assert v.pieces == (16, 4, 64) and fresh(v)
    recovered = {"phase": "backward", "micro_batch": 16, "micro_batch_to": 11, "accumulation": 6, "batch_size": 64}
    v.apply(update(events=[Event("oom_recovered", 1, recovered)], info=v.info))
    assert v.pieces == (11, 6, 64) and not fresh(v)
    v.apply(update(sample(2, micro=11, batch=64), info=v.info))  # the record: 11 x 6 by its own count
    assert v.pieces == (11, 64 // 11, 64)


@pytest.mark.parametrize("details", ["none", "strings"])
def test_a_jobs_event_without_its_details_or_with_wrong_types_is_a_line_never_a_crash(details):
    """An attach client refuses an event it cannot describe (checks.py); one it can, bare of the details
    its name always has (or each a string), leaves the view's state as it was, and everything the panels
    read still reads."""
    from gputui.telemetry.checks import checked
    from gputui.telemetry.describe import describe
    from gputui.telemetry.events import EVENTS
    from gputui.telemetry.protocol import ProtocolError, encode, parse_server

    v = view(RunInfo(total_steps=100), sample(3, micro=4, batch=16))
    shown = 0
    for name, keys in EVENTS.items():
        given = {} if details == "none" else dict.fromkeys(keys, "x")
        try:
            checked(parse_server(encode(Event(name, 3, given).to_json())))
        except ProtocolError:
            continue  # never reaches the screen
        shown += 1
        v.apply(update(events=[Event(name, 3, given)], info=v.info))
        assert v.pieces == (4, 4, 16) and v.amp in ("off", "x") and not v.checkpointing  # a newer job's AMP mode
        assert v.status in ("training", "paused") and micro_batch_once_applied(v) == 4
        assert v.timeline[0].text == describe(Event(name, 3, given)) and v.timeline[0].text
    assert v.entries == shown >= len(EVENTS) // 2 and v.skipped == 0 and v.rank_waiting is None


def test_a_welcome_replays_old_changes_before_its_last_step_whose_record_says_the_setting():
    """On attaching, the job's recent events (an old halving among them) come with its last step: the
    record, made after them, says the micro-batch; a null in the history received is no point."""
    v = RunView(clock=Clock(), script="")
    old = Event("micro_batch_changed", 2, {"from": 16, "to": 8, "accumulation": 2})
    history = {"loss": ([1, 2, 3], [0.9, None, 0.7], 1)}
    v.apply(update(sample(9, micro=16, batch=16), events=[old], info=RunInfo(), reset=True, history=history))
    assert v.pieces == (16, 1, 16)
    assert v.series.loss.steps == [1, 3, 9] and v.series.loss.values == [0.9, 0.7, 1.0]
