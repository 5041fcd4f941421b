import pytest
from samples import step_sample

from gputui.telemetry.history import History
from gputui.telemetry.hub import Hub
from gputui.telemetry.sample import Event


def test_history_keeps_the_whole_run_in_bounded_points():
    h = History(capacity=8)
    for step in range(1, 101):
        h.add(step, float(step))
    assert len(h) < 8 and h.stride == 16
    assert h.steps[-1] <= 100 and h.steps[0] <= 16  # still starts at the beginning of the run
    assert h.values == sorted(h.values)


def test_max_history_never_averages_a_peak_away():
    h = History(capacity=4, reduce=max)
    for step in range(1, 41):
        h.add(step, 1000.0 if step == 7 else 1.0)
    assert max(h.values) == 1000.0


def test_mean_history_is_the_mean_of_what_it_merged():
    h = History(capacity=4)
    for step, v in enumerate([1, 3, 5, 7, 2, 4, 6, 8], 1):
        h.add(step, float(v))
    assert h.values[0] == pytest.approx(4.0)  # 1,3,5,7
    h.add(9, float("nan"))
    assert 9 not in h.steps


def sample(step):
    return step_sample(step, t=0, batch_size=1)


def test_hub_since_hands_each_reader_what_is_new():
    hub = Hub(ring_size=4)
    s, e, cursor = hub.since((0, 0))
    assert (s, e) == ([], [])
    for i in range(1, 4):
        hub.publish(sample(i))
    hub.emit(Event("paused", 3))
    s, e, cursor = hub.since(cursor)
    assert [x.step for x in s] == [1, 2, 3] and [x.name for x in e] == ["paused"]
    for i in range(4, 11):  # more than the ring holds between two reads
        hub.publish(sample(i))
    s, e, cursor = hub.since(cursor)
    assert [x.step for x in s] == [7, 8, 9, 10] and e == []
    assert hub.since(cursor)[:2] == ([], [])
