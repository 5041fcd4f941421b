"""A rank waiting for the others at its exchange (engine/strategies/waiting.py), on stand-ins for a
collective and the job's store: the wait is sliced, a long one said with the ranks that have not
arrived, a stop ends it within its grace, and rank_timeout ends it; and how the screen and
`gputui jobs` say it. The real thing under torchrun: tests/distributed/test_stall.py."""

from __future__ import annotations

import time

import pytest
from samples import step_sample

from gputui import jobs
from gputui.engine.options import FitOptions
from gputui.engine.result import FitError
from gputui.engine.strategies import waiting
from gputui.telemetry.client import Welcome
from gputui.telemetry.describe import describe
from gputui.telemetry.paths import Job
from gputui.telemetry.run import RunInfo
from gputui.telemetry.sample import Event, StepSample
from gputui.tui.sources import Update
from gputui.tui.view import RunView


class Clock:
    """time.monotonic for waiting.py, moved on by each slice the stand-in collective waits."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Work:
    """A collective that completes after `done_after` seconds (None: never), its waits counted."""

    def __init__(self, clock: Clock, done_after: float | None) -> None:
        self.clock, self.done_after, self.waits = clock, done_after, 0

    def wait(self, timeout):
        self.waits += 1
        if self.done_after is not None and self.clock.now + timeout.total_seconds() >= self.done_after:
            self.clock.now = self.done_after
            return True
        self.clock.now += timeout.total_seconds()
        raise RuntimeError("Operation timed out!")


class Roll:
    def __init__(self, rank: int, world: int, seq: int) -> None:
        self.done = type("Done", (), {"set": lambda self: None})()

    def named(self) -> list[int]:
        return [2]


class Apart:
    ended: tuple[int, int] | None = None  # what the store says: (the other rank, its steps)
    made: list[tuple] = []

    def __init__(self, *args) -> None:
        self.done = type("Done", (), {"set": lambda self: None})()
        self.made.append(args)

    def read_again(self):
        return self.ended


@pytest.fixture
def clock(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(waiting.time, "monotonic", clock)
    monkeypatch.setattr(waiting, "Roll", Roll)
    monkeypatch.setattr(waiting, "Apart", Apart)
    monkeypatch.setattr(Apart, "made", [])
    monkeypatch.setenv("GPUTUI_RANK_WAITING_S", "2")
    return clock


def waiter(monkeypatch, stop=lambda: None, timeout_s=10.0):
    said, abandoned = [], []
    monkeypatch.setattr(waiting, "abandon", abandoned.append)

    def unanswered(ranks, waited, why):
        return FitError(f"{ranks} {waited:g} {why}")

    def ended(other, steps, closing):
        return FitError(f"apart {other} {steps} {closing}")

    w = waiting.Waiter(
        0,
        3,
        timeout_s=timeout_s,
        stop_asked=stop,
        said=lambda r, s: said.append((r, s)),
        unanswered=unanswered,
        ended=ended,
        steps=lambda: 4,
    )
    return w, said, abandoned


def test_a_collective_done_in_its_first_slice_is_one_wait(clock, monkeypatch):
    w, said, abandoned = waiter(monkeypatch)
    work = Work(clock, done_after=0.01)
    w.wait(work, 0)
    assert (work.waits, said, abandoned) == (1, [], [])


def test_a_long_wait_is_said_then_ends_at_rank_timeout(clock, monkeypatch):
    w, said, abandoned = waiter(monkeypatch)
    work = Work(clock, done_after=None)
    with pytest.raises(FitError, match=r"^\[2\] 10 None$"):
        w.wait(work, 0)
    assert [s for _, s in said] == [2.0, 4.0, 6.0, 8.0] and said[0][0] == [2]  # each threshold, the ranks missing
    assert abandoned == [work]  # kept alive: destroying it would wait for it


def test_a_wait_said_and_then_done_goes_on(clock, monkeypatch):
    w, said, abandoned = waiter(monkeypatch)
    w.wait(Work(clock, done_after=3.0), 0)
    assert len(said) == 1 and abandoned == []


def test_a_stop_ends_a_wait_after_its_grace_or_at_once_once_said(clock, monkeypatch):
    stop = []
    w, said, abandoned = waiter(monkeypatch, stop=lambda: stop[0] if stop else None)
    w.wait(Work(clock, done_after=0.1), 0)
    stop.append("interrupted")  # a rank that is alive answers within the grace: no error
    clock.now = 0.2  # a step later
    w.wait(Work(clock, done_after=clock.now + 0.5), 1)
    start = clock.now
    with pytest.raises(FitError, match="interrupted"):
        w.wait(Work(clock, done_after=None), 2)
    assert clock.now - start <= waiting.STOP_GRACE_S + waiting.SLICE_S and said == []
    stop.clear()
    work, base = Work(clock, done_after=None), clock.now
    w.stop_asked = lambda: "interrupted" if clock.now - base > 2.1 else None
    with pytest.raises(FitError, match="interrupted"):
        w.wait(work, 3)  # said at 2 s, then stopped: at once
    assert len(said) == 1 and abandoned[-1] is work and clock.now - base <= 2.1 + waiting.SLICE_S


def test_the_transport_giving_up_first_names_the_ranks_too(clock, monkeypatch):
    class TimedOut(Work):
        def wait(self, timeout):
            raise RuntimeError("[gloo/unbound_buffer.cc:78] Timed out waiting 600000ms for recv operation")

    w, _, _ = waiter(monkeypatch)
    with pytest.raises(FitError, match=r"^\[1, 2\] 0 None$"):  # not read yet: every other rank
        w.wait(TimedOut(clock, None), 0)


def test_a_wait_ends_in_seconds_when_a_run_ended_apart(clock, monkeypatch):
    """Apart starts after APART_AFTER_S, knowing the steps done and whether this is the closing exchange;
    once it reads that the run ended on one rank and went on on another, the wait ends with that error."""
    monkeypatch.setattr(Apart, "ended", (1, 3))
    w, said, abandoned = waiter(monkeypatch, timeout_s=600)
    w.closing = True
    work = Work(clock, done_after=None)
    with pytest.raises(FitError, match="^apart 1 3 True$"):
        w.wait(work, 7)
    assert Apart.made == [(0, 7, 4, True)] and abandoned == [work]
    assert waiting.APART_AFTER_S <= clock.now <= waiting.APART_AFTER_S + waiting.SLICE_S


def test_a_rank_that_left_having_read_the_run_ended_apart_is_named_so(clock, monkeypatch):
    """The other rank read it first and left: the transport says the peer is gone, one more read why."""

    class Gone(Work):
        def wait(self, timeout):
            if self.clock.now >= 2.5:
                raise RuntimeError("Connection closed by peer [127.0.0.1]:45735")
            return super().wait(timeout)

    w, _, _ = waiter(monkeypatch)
    monkeypatch.setattr(Apart, "read_again", lambda self: (1, 4))
    with pytest.raises(FitError, match="^apart 1 4 False$"):
        w.wait(Gone(clock, None), 7)


class Store(dict):
    """The job's store, as the roll and Apart call it."""

    def set(self, key, value):
        self[key] = value.encode()

    def check(self, keys):
        return all(k in self for k in keys)

    def get(self, key):
        return self[key]


def settled(reader, until) -> None:
    deadline = time.monotonic() + 10
    while not until():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    reader.done.set()


def test_a_closing_rank_and_one_gone_on_each_read_the_other(monkeypatch):
    """Rank 0 closes after 3 steps (closing exchange 9); rank 1 waits in its 4th: it reads rank 0's key, says
    it went on and ends; rank 0 reads that."""
    store = Store()
    monkeypatch.setattr(waiting, "store", lambda: store)
    closing = waiting.Apart(0, 9, 3, closing=True)
    settled_closed = time.monotonic() + 10
    while waiting.CLOSED not in store:
        assert time.monotonic() < settled_closed
        time.sleep(0.01)
    assert store[waiting.CLOSED] == b"0 3 9"
    went_on = waiting.Apart(1, -4, 3, closing=False)
    settled(went_on, lambda: went_on.ended is not None)
    assert went_on.ended == (0, 3) and store[waiting.WENT_ON] == b"1 3 9"
    settled(closing, lambda: closing.ended is not None)
    assert closing.ended == (1, 3)


@pytest.mark.parametrize(
    ("kept", "mine"),
    [
        ({waiting.CLOSED: b"0 2 5"}, (1, 7, 3, False)),  # closed after 2 steps: an older part of the run
        ({waiting.WENT_ON: b"1 3 5"}, (0, 9, 3, True)),  # went on past closing exchange 5, not this one (9)
    ],
)
def test_keys_of_an_older_part_of_the_run_say_nothing(monkeypatch, kept, mine):
    store = Store(kept)
    monkeypatch.setattr(waiting, "store", lambda: store)
    reads = []
    real = waiting.Apart._read
    monkeypatch.setattr(waiting.Apart, "_read", lambda self, s: reads.append(1) or real(self, s))
    apart = waiting.Apart(*mine)
    settled(apart, lambda: len(reads) >= 1)
    assert apart.ended is None and dict(store).get(waiting.WENT_ON) == kept.get(waiting.WENT_ON)  # none said it went on


def test_ranks_that_closed_together_leave_no_key_that_says_anything(monkeypatch):
    """The closing key is overwritten, never deleted: a rank that checked it is there still gets it."""
    store = Store()
    monkeypatch.setattr(waiting, "store", lambda: store)
    apart = waiting.Apart(0, 9, 3, closing=True)
    settled(apart, lambda: waiting.CLOSED in store)
    deadline = time.monotonic() + 10
    while store[waiting.CLOSED] == b"0 3 9":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert apart.ended is None and waiting.CLOSED in store
    later = waiting.Apart(1, 10, 3, closing=False)  # a later part's wait, after the same 3 steps
    reads = []
    real = waiting.Apart._read
    monkeypatch.setattr(waiting.Apart, "_read", lambda self, s: reads.append(1) or real(self, s))
    settled(later, lambda: len(reads) >= 1)
    assert later.ended is None and waiting.WENT_ON not in store


def test_the_roll_names_the_ranks_that_have_not_reached_this_exchange(monkeypatch):
    store = Store({"gputui/waiting/1": b"7", "gputui/waiting/2": b"6"})  # rank 2 waited at an earlier one
    monkeypatch.setattr(waiting, "store", lambda: store)
    roll = waiting.Roll(0, 4, 7)
    deadline = time.monotonic() + 10
    while roll.missing is None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    roll.done.set()
    assert roll.named() == [2, 3] and store["gputui/waiting/0"] == b"7"


EVENT = Event("rank_waiting", 3, {"ranks": [1], "at": 4, "waited_s": 61}, t=1000.0)


def step(n: int, t: float | None = None) -> StepSample:
    """Step `n`'s record, published at `t` (1000 + n by default)."""
    return step_sample(n, t=1000.0 + n if t is None else t, samples_per_s=8.0)


def test_the_screen_says_it_counting_on_until_the_next_step():
    v = RunView(clock=lambda: 0.0, script="ddp.py", wall=lambda: 1009.4)
    v.apply(Update([step(3)], [EVENT], RunInfo(total_steps=100), None, None, 1))
    assert v.status == "waiting for rank 1 since step 4 (70s)" and v.eta is None
    v.apply(Update([step(4)], [], v.info, None, None, 1))
    assert v.status == "training" and v.eta is not None


def test_jobs_says_a_rank_waits_until_its_next_step(monkeypatch):
    monkeypatch.setattr(jobs.time, "time", lambda: 1005.0)
    welcome = Welcome(hello={"info": RunInfo(argv=("ddp.py",), rank=0, world_size=2).to_json()})
    welcome.latest = step(3, t=1.0)
    welcome.events.append(EVENT.to_json())
    row = jobs._row(Job(1, "/tmp/x.sock"), welcome)
    assert row["state"] == "waiting" and row["waiting"] == "waiting for rank 1 since step 4 (66s)"
    assert row["summary"].endswith("(waiting for rank 1 since step 4 (66s))")
    assert describe(EVENT) == "waiting for rank 1 since step 4 (61s)"


def test_jobs_says_a_job_is_paused_until_it_resumes():
    """`gputui jobs` says what the job's screen says: paused from the pause (a key, an OOM) to the resume."""
    welcome = Welcome(hello={"info": RunInfo(argv=("train.py",)).to_json()})
    welcome.latest = step(3, t=1.0)

    def state() -> str:
        return jobs._row(Job(1, "/tmp/x.sock"), welcome)["state"]

    assert state() == "training"
    welcome.events.append(Event("paused", 3, {"reason": "oom"}, t=1001.0).to_json())
    assert state() == "paused"
    welcome.events.append(Event("control_refused", 3, {"action": "plan"}, t=1002.0).to_json())
    assert state() == "paused"
    welcome.events.append(Event("resumed", 3, {}, t=1003.0).to_json())
    assert state() == "training"


@pytest.mark.parametrize("value", ["0", "-1", "soon", "inf"])
def test_the_waiting_threshold_and_the_kill_delay_are_positive_numbers(monkeypatch, value):
    from gputui.torchrun import TorchrunJob

    monkeypatch.setenv("GPUTUI_RANK_WAITING_S", value)
    with pytest.raises(ValueError, match="GPUTUI_RANK_WAITING_S must be a positive number of seconds"):
        waiting.waiting_threshold()
    monkeypatch.setenv("GPUTUI_KILL_AFTER_S", value)
    with pytest.raises(ValueError, match="GPUTUI_KILL_AFTER_S must be a positive number of seconds"):
        TorchrunJob(2, ["gputui", "run", "--headless", "train.py"])  # refused before torchrun starts
    monkeypatch.setenv("GPUTUI_KILL_AFTER_S", "2.5")
    monkeypatch.setattr("subprocess.Popen", lambda *args, **kwargs: None)
    assert TorchrunJob(2, ["gputui", "run", "--headless", "train.py"]).kill_after == 2.5


def test_rank_timeout_is_a_positive_number():
    for bad in (0, -1, "600", True, float("inf")):
        with pytest.raises(ValueError, match="rank_timeout must be a positive number of seconds"):
            FitOptions(rank_timeout=bad)
