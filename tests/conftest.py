import os
from pathlib import Path

# The suite's models are tiny: a second intra-op thread only spins against the other tests and processes of
# a busy 2-core machine (it doubled the CPU the fast lane takes; a 10 ms step of the demo GPT took over a
# second so). Set before anything loads torch, and inherited by every process the tests start.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest

from gputui.telemetry import hub as hubs

INTEGRATION = Path(__file__).parent / "integration"

pytest_plugins = ["process"]  # starting, waiting for and ending the processes tests start: tests/process.py


def pytest_collection_modifyitems(items):
    """Every integration test runs real processes: marked `process` here, once, for the fast lane
    (`pytest -m "not process and not distributed"`)."""
    for item in items:
        if INTEGRATION in Path(item.path).parents:
            item.add_marker(pytest.mark.process)


@pytest.fixture(autouse=True, scope="session")
def private_socket_folder(tmp_path_factory):
    """Each test process (each xdist worker) gets its own XDG_RUNTIME_DIR, inherited by the jobs
    the tests start: `gputui jobs` in one test never lists another's job, nor the user's own."""
    runtime = tmp_path_factory.mktemp("runtime")
    runtime.chmod(0o700)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_RUNTIME_DIR", str(runtime))
        yield runtime


@pytest.fixture(autouse=True)
def hub():
    """A fresh, silent hub for each test: fit() publishes here instead of printing a progress line."""
    h = hubs.Hub()
    hubs.install(h)
    yield h
    hubs.install(None)


@pytest.fixture
def runtime_dir(tmp_path, monkeypatch):
    """The test's own XDG_RUNTIME_DIR: the sockets its servers make are its alone."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    return tmp_path
