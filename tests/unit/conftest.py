import pytest

from gputui.plan import planner


@pytest.fixture(autouse=True)
def unhurried(monkeypatch):
    """Tables and picks traced within their time budgets, however loaded the machine: a budget run out
    splits a table over two boundaries (two plan events) or picks from what it found (halving, another
    size), which the tests do not ask about unless they set a budget themselves. On a slow 2-core
    machine running the suite, the traces after an OOM took past OOM_S."""
    for name in ("BOUNDARY_S", "ASKED_S", "OOM_S"):
        monkeypatch.setattr(planner, name, 60.0)
