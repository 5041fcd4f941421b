"""A headless job's prints reach an attached client, while its own stdout stays what it printed."""

import os
import pty
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from helpers import socket_of

from gputui.telemetry.client import Connection

SCRIPT = """
import os, sys, time, torch
from torch import nn

print("hello from the script")
print("\\x1b[31mred\\x1b[0m text")
model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
step = 0
while not os.path.exists(sys.argv[1]):
    step += 1
    loss = nn.functional.cross_entropy(model(torch.randn(16, 8)), torch.randint(2, (16,)))
    opt.zero_grad(); loss.backward(); opt.step()
    sys.stderr.write(f"\\rprogress {step}")
    if step % 10 == 0:
        print(f"\\nstep {step}")
    time.sleep(0.01)
print("\\ndone")
"""


@pytest.fixture
def env(tmp_path):
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    return {**os.environ, "XDG_RUNTIME_DIR": str(runtime), "PYTHONUNBUFFERED": "1"}


def read_output(conn, until):
    """The output lines of the records read until `until(lines, record)` holds (or the stream ends)."""
    lines = []
    while (record := conn.read()) is not None:
        if record["kind"] == "output":
            lines += record["lines"]
        if until(lines, record):
            break
    return lines


def test_attach_to_a_headless_job_sees_its_prints(env, tmp_path):
    script = tmp_path / "own.py"
    script.write_text(textwrap.dedent(SCRIPT))
    finish = tmp_path / "finish"
    proc = subprocess.Popen(
        [sys.executable, "-m", "gputui", "run", "--headless", str(script), str(finish)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,  # bytes: text mode would turn each "\r" into a newline
    )
    try:
        path = socket_of(env, proc.pid)
        with Connection(path, timeout=60) as first:  # possibly before the script printed anything
            read_output(first, lambda lines, record: "step 20" in lines)
        with Connection(path, timeout=60) as conn:
            welcome = read_output(conn, lambda lines, record: record["kind"] == "live")
            assert welcome[:2] == ["hello from the script", "red text"], "escape sequences stripped"
            assert "step 20" in welcome
            finish.touch()
            lines = welcome + read_output(conn, lambda lines, record: False)
        assert lines[-1] == "done", "the last lines go out before the socket closes"
        steps = [int(line.split()[1]) for line in lines if line.startswith("step")]
        assert steps == list(range(10, steps[-1] + 1, 10)), "each line once, in order"
        if lines[-2:] == ["", "done"]:  # the script stopped right after a "step" line: its "\\ndone" ends an empty one
            del lines[-2]
        assert all(line.startswith(("hello", "red", "step", "progress", "done")) for line in lines), lines
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err.decode()
        assert b"hello from the script\n\x1b[31mred\x1b[0m text\n" in out, "stdout as the script wrote it"
        assert b"\rprogress 1\rprogress 2" in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)


def test_attach_to_a_tui_job_sees_its_prints(env, tmp_path):
    """`gputui run` in a terminal: what the app captures goes into the hub the socket serves."""
    script = tmp_path / "own.py"
    script.write_text(textwrap.dedent(SCRIPT))
    finish = tmp_path / "finish"
    pid, master = pty.fork()
    if pid == 0:
        os.execve(
            sys.executable,
            [sys.executable, "-m", "gputui", "run", str(script), str(finish)],
            {**env, "TERM": "xterm-256color"},
        )
    screen = threading.Thread(target=lambda: _drain(master), daemon=True)  # the terminal reads what it draws
    screen.start()
    try:
        with Connection(socket_of(env, pid), timeout=60) as conn:
            lines = read_output(conn, lambda lines, record: "step 20" in lines)
            assert lines[:2] == ["hello from the script", "red text"]
            finish.touch()
            lines += read_output(conn, lambda lines, record: "done" in lines)
        assert lines[-1] == "done"
        os.write(master, b"q")  # the script has ended: the app stays until the user leaves
        deadline = time.monotonic() + 30
        while (status := os.waitpid(pid, os.WNOHANG))[0] == 0:
            assert time.monotonic() < deadline, "the job did not end"
            time.sleep(0.1)
        assert os.waitstatus_to_exitcode(status[1]) == 0
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _drain(fd):
    try:
        while os.read(fd, 65536):
            pass
    except OSError:
        pass
