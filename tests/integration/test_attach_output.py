"""A headless job's prints reach an attached client, while its own stdout stays what it printed."""

import subprocess
import sys
import textwrap

from process import socket_of

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


def read_output(conn, until):
    """The output lines of the records read until `until(lines, record)` holds (or the stream ends)."""
    lines = []
    while (record := conn.read()) is not None:
        if record["kind"] == "output":
            lines += record["lines"]
        if until(lines, record):
            break
    return lines


def test_attach_to_a_headless_job_sees_its_prints(env, tmp_path, processes):
    script = tmp_path / "own.py"
    script.write_text(textwrap.dedent(SCRIPT))
    finish = tmp_path / "finish"
    proc = processes.gputui(
        "run",
        "--headless",
        script,
        finish,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,  # bytes: text mode would turn each "\r" into a newline
    )
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


def test_attach_to_a_tui_job_sees_its_prints(env, tmp_path, processes):
    """`gputui run` in a terminal: what the app captures goes into the hub the socket serves."""
    script = tmp_path / "own.py"
    script.write_text(textwrap.dedent(SCRIPT))
    finish = tmp_path / "finish"
    run = processes.terminal([sys.executable, "-m", "gputui", "run", script, finish], env)
    with Connection(socket_of(env, run.pid), timeout=60) as conn:
        lines = read_output(conn, lambda lines, record: "step 20" in lines)
        assert lines[:2] == ["hello from the script", "red text"]
        finish.touch()
        lines += read_output(conn, lambda lines, record: "done" in lines)
    assert lines[-1] == "done"
    run.send(b"q")  # the script has ended: the app stays until the user leaves
    assert run.exit_code() == 0
