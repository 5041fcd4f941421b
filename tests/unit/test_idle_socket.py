"""Between steps over a real socket: an attach client is told when the job's script has worked outside a
step for a while (hub.idle_since, older than IDLE_S), and when a step starts again; one that connects
meanwhile is told in its welcome."""

import os
import time

import pytest
from test_server import sample, until

from gputui.telemetry.client import Connection, Mirror
from gputui.telemetry.hub import IDLE_S, Hub
from gputui.telemetry.run import RunInfo
from gputui.telemetry.sample import Event
from gputui.telemetry.server import TelemetryServer

pytestmark = pytest.mark.usefixtures("runtime_dir")  # each test's sockets in its own folder


@pytest.fixture
def served():
    hub = Hub()
    server = TelemetryServer(hub).start()
    hub.start(RunInfo(device="cpu", total_steps=3))
    hub.publish(sample(1))
    yield hub, server
    server.close()


def test_a_client_is_told_when_the_script_is_between_steps_and_when_a_step_starts(served):
    hub, server = served
    mirror = Mirror(server.path, os.getpid()).start()
    until(lambda: mirror.generation == 1 and mirror.hub.latest() is not None)
    assert mirror.hub.idle_since is None
    left = time.time() - IDLE_S - 5  # outside a step for longer than IDLE_S
    hub.idle_since = left
    until(lambda: mirror.hub.idle_since == left, what=lambda: mirror.hub.idle_since)
    hub.idle_since = None  # a step starts
    until(lambda: mirror.hub.idle_since is None, what=lambda: mirror.hub.idle_since)
    mirror.stop()


def test_the_hub_is_between_steps_only_once_outside_a_step_for_idle_s():
    hub = Hub()
    assert hub.idle() is None
    hub.idle_since = time.time()  # a step just ended: its gap to the next is no pause
    assert hub.idle() is None
    hub.idle_since = left = time.time() - IDLE_S
    assert hub.idle() == left


def test_a_client_connecting_between_steps_is_told_in_its_welcome(served):
    hub, server = served
    left = time.time() - IDLE_S - 5
    hub.idle_since = left
    until(lambda: server._so_far.idle_since == left)
    with Connection(server.path) as conn:
        assert conn.welcome().hello["idle_since"] == left
    mirror = Mirror(server.path, os.getpid()).start()
    until(lambda: mirror.generation == 1)
    assert mirror.hub.idle_since == left
    mirror.stop()


def test_a_continued_run_is_in_a_later_clients_welcome(served):
    hub, server = served
    hub.emit(Event("run_continued", 1, {"refused": {}, "total_steps": 5, "auto_recover": False}))
    until(lambda: len(server._so_far.events) == 1)
    with Connection(server.path) as conn:
        info = conn.welcome().info
    assert (info.total_steps, info.auto_recover) == (5, False)
