import io
import sys
import textwrap
import threading
import time

import pytest
from process import python

from gputui import interrupts


def test_an_interrupt_lands_in_the_saving_thread_right_after_its_outermost_save():
    saving, go, done = threading.Event(), threading.Event(), []

    def script():
        try:
            with interrupts.saving("outer.pt"):
                with interrupts.saving("inner.pt"):
                    saving.set()
                    go.wait(10)
                done.append("inner saved")  # still inside the outer save
            done.append("went on")  # never: the interrupt lands first
        except KeyboardInterrupt:
            done.append("interrupted")

    thread = threading.Thread(target=script, daemon=True)
    thread.start()
    assert saving.wait(10)
    interrupts.interrupt(thread, KeyboardInterrupt)
    announced = []
    interrupts.wait_for_saves(lambda path: (announced.append(path), go.set()))
    thread.join(10)
    assert announced == ["outer.pt", "inner.pt"]
    assert done == ["inner saved", "interrupted"]


@pytest.mark.process
def test_the_process_never_exits_mid_save(tmp_path):
    saved = tmp_path / "saved"
    code = textwrap.dedent(f"""
        import threading
        from gputui import interrupts

        saving, go = threading.Event(), threading.Event()
        def save():
            with interrupts.saving("model.pt"):
                saving.set()
                go.wait(10)
                open({str(saved)!r}, "w").close()
            threading.Event().wait()  # then stuck: the exit does not wait for this

        threading.Thread(target=save, daemon=True).start()
        saving.wait(10)
        interrupts.exit_after_saves(5, lambda path: go.set())
    """)
    done = python("-c", code)
    assert done.returncode == 5, done.stderr
    assert saved.exists()


class _Blocked(io.RawIOBase):
    """A stderr whose write is interrupted by a signal: the handler runs inside the buffered writer's
    write, its lock held, as when a write blocked on a full pipe (`| tee`) or a terminal held by Ctrl-S
    takes a Ctrl-C."""

    def __init__(self) -> None:
        self.written = bytearray()
        self.handled = False

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        if not self.handled:
            self.handled = True
            interrupts.notice("gputui: interrupt: finishing the current step\n")
        self.written += bytes(b)
        return len(b)


def test_a_notice_from_a_handler_that_interrupted_a_write_to_stderr_does_not_raise(monkeypatch):
    raw = _Blocked()
    monkeypatch.setattr(sys, "stderr", io.TextIOWrapper(io.BufferedWriter(raw), line_buffering=True))
    sys.stderr.write("step 7/100 | loss 2.31\n")  # the progress line the signal landed in
    assert raw.handled and raw.written.decode() == "step 7/100 | loss 2.31\n"  # written whole; the notice lost


def test_a_forked_child_takes_a_signal_as_it_would_without_gputui():
    """A DataLoader worker forked from a training process would inherit gputui's stop handlers, and a Ctrl-C
    to the process group or the loader's terminate() reaches it: there SIGINT raises KeyboardInterrupt (the
    worker loop's cue that its parent stops) and SIGTERM ends it, with no "finishing the current step" line.
    The parent keeps its handlers."""
    import os
    import signal

    said = []
    handler = interrupts.ours(lambda signum, frame: said.append(signum))
    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        child = os.fork()
        if child == 0:
            try:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(1)
            except KeyboardInterrupt:
                os._exit(7)
            os._exit(1)
        assert os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]) == 7
        child = os.fork()
        if child == 0:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)
            os._exit(1)  # never: the default action ended it
        assert os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]) == -signal.SIGTERM
        assert signal.getsignal(signal.SIGINT) is handler and not said  # the parent's own, untouched
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
