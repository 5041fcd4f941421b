"""`gputui run`'s signal handlers (tui/local.py) run in the main thread, which may hold the hub's lock
(taking a sink off it while the screen's server closes): they must not take it."""

import os
import signal

from gputui.telemetry.hub import Hub
from gputui.tui import local


class Screen:
    def __init__(self):
        self.told = []

    def signalled(self, step, reason):
        self.told.append((step, reason))

    def signal(self, signum):
        pass


def test_a_stop_signal_while_the_main_thread_holds_the_hubs_lock_is_taken_at_once():
    hub, state = Hub(), local._State()
    state.screen = Screen()
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    local._install_signals(hub, state)
    try:
        with hub._lock:  # as hub.remove_sink() holds it
            os.kill(os.getpid(), signal.SIGTERM)  # the handler runs here, in this thread
        assert hub.stop_signal == "terminated" and state.screen.told == [(0, "terminated")]
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
