"""The screen of a process's one run (engine/continuity.py): "between steps" while the script works
outside a step, a continued run's length and setting, "finished" only when the script's run ends."""

from test_view import Clock, sample, update

from gputui.telemetry.hub import IDLE_S, Hub
from gputui.telemetry.run import RunInfo, RunSummary
from gputui.telemetry.sample import Event
from gputui.tui.sources import LocalSource
from gputui.tui.view import RunView

WALL = 5000.0


def view() -> RunView:
    v = RunView(clock=Clock(), wall=lambda: WALL, script="train.py")
    v.apply(update(sample(1), info=RunInfo(total_steps=3, auto_recover=True)))
    return v


def continued(step: int, **details) -> Event:
    return Event("run_continued", step, {"refused": {}, **details})


def test_between_steps_once_the_script_has_been_outside_a_step_for_a_while():
    v = view()
    v.apply(update(info=v.info, idle_since=WALL - IDLE_S / 10))  # a step's own gap
    assert v.status == "training"
    v.apply(update(info=v.info, idle_since=WALL - IDLE_S))
    assert v.status == "between steps" and v.training
    v.apply(update(sample(2), info=v.info, idle_since=None))  # a step trains again
    assert v.status == "training"


def test_a_continued_run_changes_the_total_and_auto_recover_and_finishes_only_with_the_script():
    v = view()
    part_ended = Event("part_ended", 3, {"by": "fit", "steps": 3, "samples": 24})
    v.apply(update(sample(2), sample(3), events=[part_ended], info=v.info, idle_since=WALL - 10))
    assert v.status == "between steps"  # not "finished": the script goes on
    event = continued(3, total_steps=8, auto_recover=False)
    v.apply(update(events=[event], info=v.info.continued(event.details), idle_since=None))  # as the hub folds it
    assert (v.total_steps, v.auto_recover, v.status) == (8, False, "training")
    v.apply(update(sample(8), info=v.info, idle_since=WALL - 10))
    assert v.status == "between steps"
    v.apply(update(info=v.info, summary=RunSummary(steps=8), idle_since=WALL - 10))
    assert v.status == "finished" and not v.training


def test_what_a_continued_run_changed_stays_across_later_polls_of_the_hub():
    """The hub keeps the info the run started with; the view, what `run_continued` made of it."""
    hub = Hub()
    hub.start(RunInfo(total_steps=3, auto_recover=True))
    source, v = LocalSource(hub), RunView(clock=Clock(), wall=lambda: WALL)
    v.apply(source.poll())
    hub.emit(continued(3, total_steps=8, auto_recover=False))
    v.apply(source.poll())
    assert (v.total_steps, v.auto_recover) == (8, False)
    hub.publish(sample(4))
    v.apply(source.poll())
    assert (v.total_steps, v.auto_recover) == (8, False)
