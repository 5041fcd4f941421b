import textwrap
import threading

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
