import pytest

from gputui.telemetry import hub as hubs


@pytest.fixture(autouse=True)
def hub():
    """A fresh, silent hub for each test: fit() publishes here instead of printing a progress line."""
    h = hubs.Hub()
    hubs.install(h)
    yield h
    hubs.install(None)
