import threading

import pytest

from gputui.telemetry.controls import Control, Controls


def test_validation_names_the_problem():
    with pytest.raises(ValueError, match="unknown action 'explode'"):
        Control("explode")
    with pytest.raises(ValueError, match="set_amp takes one of off, bf16, fp16"):
        Control("set_amp", "fp8")
    with pytest.raises(ValueError, match="set_checkpointing takes one of true, false"):
        Control("set_checkpointing", 1)
    with pytest.raises(ValueError, match="halve_batch takes no value"):
        Control("halve_batch", 2)
    assert Control("set_checkpointing", False).value is False


def test_drain_is_fifo_and_empties():
    q = Controls()
    a, b = q.request("pause"), q.request("set_amp", "bf16", source="tui")
    assert a.id < b.id and b.source == "tui"
    assert q.drain() == [a, b]
    assert q.drain() == [] and len(q) == 0


def test_many_threads_lose_nothing():
    q = Controls()
    drained = []
    done = threading.Event()

    def consumer():
        while not done.is_set() or len(q):
            if q.wait(0.01):
                drained.extend(q.drain())

    c = threading.Thread(target=consumer)
    c.start()
    producers = [threading.Thread(target=lambda: [q.request("free_cache") for _ in range(500)]) for _ in range(4)]
    for p in producers:
        p.start()
    for p in producers:
        p.join()
    done.set()
    c.join(5)
    assert len(drained) == 2000 and len({c.id for c in drained}) == 2000


def test_wait_wakes_on_request():
    q = Controls()
    threading.Timer(0.05, lambda: q.request("resume")).start()
    assert q.wait(5) is True
    assert Controls().wait(0.01) is False
