"""`gputui run --nproc-per-node N`: torchrun's ranks headless, the TUI attached to rank 0, on a real
pseudo-terminal. Every process is bounded: the launch by the waits below, the argument errors by
subprocess timeouts."""

from __future__ import annotations

import contextlib
import json
import os
import pty
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import os, signal, sys, time
import gputui, torch
from torch import nn

rank = int(os.environ.get("RANK", "0"))
if os.environ.get("STALL"):  # rank 1 stops answering after its step 3
    from gputui.telemetry import hub as hubs

    class Stall(hubs.Sink):
        def on_sample(self, sample):
            if rank == 1 and sample.step == 3:
                os.kill(os.getpid(), signal.SIGSTOP)

    hubs.current().add_sink(Stall())

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
data = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(20_000)]

def step(model, batch):
    time.sleep(0.02)
    return nn.functional.mse_loss(model(batch[0]), batch[1])

steps = int(sys.argv[1]) if len(sys.argv) > 1 else None
try:
    result = gputui.fit(model, data, step, torch.optim.SGD(model.parameters(), lr=0.01), max_steps=steps)
finally:  # the script's save
    open(f"saved.{rank}", "w").close()
print(f"after fit: rank {result.rank} of {result.world_size} stopped {result.stopped} at step {result.steps}")
if steps and result.rank == 1:
    sys.exit(3)
"""


@pytest.fixture
def env(tmp_path):
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    return {
        **os.environ,
        "XDG_RUNTIME_DIR": str(runtime),
        "TMPDIR": str(tmp_path),  # the job's log goes there
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "TERM": "xterm-256color",
    }


def gputui_run(env, *args, stdin=None):
    return subprocess.run(
        [sys.executable, "-m", "gputui", "run", *args],
        env=env,
        stdin=stdin,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_argument_errors_say_one_line_and_exit_2(env, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    with open(os.devnull) as null:  # no terminal: every case but the last one fails before it is checked
        cases = {
            ("--nproc-per-node", "2", "--headless", str(script)): "run torchrun yourself",
            ("--nproc-per-node", "0", str(script)): "--nproc-per-node takes 1 or more",
            ("--nproc-per-node", "2", str(tmp_path / "missing.py")): "no such script",
            ("--nproc-per-node", "2", str(script)): "the TUI needs a terminal; use `torchrun --nproc-per-node N",
        }
        for args, said in cases.items():
            done = gputui_run(env, *args, stdin=null)
            assert done.returncode == 2, (args, done.stderr)
            assert done.stderr.count("\n") == 1 and said in done.stderr, (args, done.stderr)
    assert not list(tmp_path.glob("gputui-torchrun-*.log")), "nothing was launched"


class Screen:
    """What the app draws on the pseudo-terminal, read as it comes (the terminal must be read)."""

    def __init__(self, master: int) -> None:
        self.master, self.data = master, bytearray()
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        try:
            while chunk := os.read(self.master, 65536):
                self.data += chunk
        except OSError:  # EIO: the child side closed
            pass

    def text(self) -> str:
        return re.sub(r"\x1b\[[0-9;?<>=$]*[A-Za-z]", " ", self.data.decode("utf-8", "replace"))

    def wait_for(self, *texts: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not all(t in self.text() for t in texts):
            assert time.monotonic() < deadline, f"never shown: {texts}; screen: {self.text()[-3000:]}"
            time.sleep(0.1)


def wait_exit(pid: int, screen: Screen, timeout: float = 90) -> int:
    deadline = time.monotonic() + timeout
    while (status := os.waitpid(pid, os.WNOHANG))[0] == 0:
        assert time.monotonic() < deadline, f"still running; screen: {screen.text()[-3000:]}"
        time.sleep(0.1)
    return os.waitstatus_to_exitcode(status[1])


def launch(env, tmp_path, *args):
    """`gputui run --nproc-per-node 2 ... train.py ARGS` on a pseudo-terminal: its pid, master fd, screen."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    argv = [sys.executable, "-m", "gputui", "run", "--nproc-per-node", "2", *args[:-1], str(script), *args[-1]]
    pid, master = pty.fork()
    if pid == 0:
        os.chdir(tmp_path)
        os.execve(argv[0], argv, env)
    return pid, master, Screen(master)


def kill(pid, master, ranks=()):
    """What is left of a failed test: torchrun and its ranks run in sessions of their own, each is killed."""
    if pid:
        left = [p.pid for p in psutil.Process(pid).children(recursive=True)] + [*ranks, pid]
        for each in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(each, signal.SIGKILL)
        os.waitpid(pid, 0)
    os.close(master)


def test_q_stops_every_rank_after_the_same_step_and_the_script_goes_on(env, tmp_path):
    """Two ranks under the TUI: the header says rank 0 of 2 and the ranks panel shows both; q (and its
    confirmation) stops both ranks, whose scripts go on after fit; the exit code is torchrun's, 0; no
    rank is left; the flags reached the ranks (each writes its metrics file)."""
    pid, master, screen = launch(env, tmp_path, "--metrics", "m.jsonl", ())
    ranks: list[int] = []
    try:
        screen.wait_for("rank 0 of 2", "ranks · 2 in the job", "rank 1 ")
        ranks = [int(p.name.split(".")[0]) for p in (tmp_path / "run" / "gputui").glob("*.sock")]
        assert len(ranks) == 2, ranks
        os.write(master, b"q")
        screen.wait_for("Stop after the current step and quit?", timeout=30)
        os.write(master, b"y")
        assert wait_exit(pid, screen) == 0, screen.text()[-3000:]
        pid = 0
        log = Path(re.search(r"their output goes to (\S+\.log)", screen.text())[1])
        assert log.parent == tmp_path
        text = log.read_text()
        stops = re.findall(r"after fit: rank (\d) of 2 stopped interrupted at step (\d+)", text)
        assert sorted(r for r, _ in stops) == ["0", "1"] and stops[0][1] == stops[1][1], text[-3000:]
        assert f"output, every rank's: {log}" in screen.text(), "the log is named when the TUI ends"
        for name in ("m.jsonl", "m.rank1.jsonl"):
            end = json.loads((tmp_path / name).read_text().splitlines()[-1])
            assert (end["kind"], end["stopped"], end["steps"]) == ("end", "interrupted", int(stops[0][1])), name
        deadline = time.monotonic() + 10
        while alive := [r for r in ranks if psutil.pid_exists(r)]:
            assert time.monotonic() < deadline, f"ranks left running: {alive}"
            time.sleep(0.1)
    finally:
        kill(pid, master, ranks)


def test_a_job_that_ends_on_its_own_is_shown_ended_and_gives_its_exit_code(env, tmp_path):
    """Both ranks train 5 steps, then rank 1 exits 3: torchrun reports the failure (1), the TUI shows it
    with the log's last lines, and q leaves with torchrun's code."""
    pid, master, screen = launch(env, tmp_path, ("5",))
    try:
        screen.wait_for("rank 0 of 2", "torchrun ended with exit code 1", "Root Cause")
        os.write(master, b"q")
        assert wait_exit(pid, screen) == 1
        pid = 0
        log = Path(re.search(r"their output goes to (\S+\.log)", screen.text())[1]).read_text()
        assert "after fit: rank 0 of 2 stopped None at step 5" in log and "exitcode  : 3" in log, log[-3000:]
    finally:
        kill(pid, master)


def test_q_while_a_rank_is_stalled_ends_the_job_with_the_rank_named_and_the_save(env, tmp_path):
    """Rank 1 stops answering (SIGSTOP): rank 0's screen says it waits for rank 1; q (confirmed) ends
    rank 0's wait at once with a FitError naming rank 1, after which its script's save runs; the job
    ends, bounded (the stopped rank is killed after the TUI's grace)."""
    pid, master, screen = launch(env | {"STALL": "1", "GPUTUI_RANK_WAITING_S": "1"}, tmp_path, ())
    try:
        screen.wait_for("waiting for rank 1 since step 4")
        os.write(master, b"q")
        screen.wait_for("Stop after the current step and quit?", timeout=30)
        os.write(master, b"y")
        assert wait_exit(pid, screen) != 0
        pid = 0
        log = Path(re.search(r"their output goes to (\S+\.log)", screen.text())[1]).read_text()
        said = "rank 0 stopped (interrupted) while waiting for rank 1, which stopped answering at step 4"
        assert said in log, log[-3000:]
        assert (tmp_path / "saved.0").exists() and not (tmp_path / "saved.1").exists()
    finally:
        kill(pid, master)
