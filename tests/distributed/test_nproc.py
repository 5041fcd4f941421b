"""`gputui run --nproc-per-node N`: torchrun's ranks headless, the TUI attached to rank 0, on a real
pseudo-terminal. Every process is bounded: the launch by the waits below (and ended with its ranks
when the test ends), the argument errors by process.run's timeout."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import psutil
import pytest
from process import gputui, wait_until

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
def env(env, tmp_path):
    """process.py's, for torchrun's ranks."""
    return {
        **env,
        "TMPDIR": str(tmp_path),  # the job's log goes there
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }


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
            done = gputui("run", *args, env=env, stdin=null)
            assert done.returncode == 2, (args, done.stderr)
            assert done.stderr.count("\n") == 1 and said in done.stderr, (args, done.stderr)
    assert not list(tmp_path.glob("gputui-torchrun-*.log")), "nothing was launched"


def launch(processes, env, tmp_path, *args):
    """`gputui run --nproc-per-node 2 ... train.py ARGS` on a pseudo-terminal (a Terminal)."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    argv = [sys.executable, "-m", "gputui", "run", "--nproc-per-node", "2", *args[:-1], script, *args[-1]]
    return processes.terminal(argv, env, cwd=tmp_path)


def test_q_stops_every_rank_after_the_same_step_and_the_script_goes_on(env, tmp_path, processes):
    """Two ranks under the TUI: the header says rank 0 of 2 and the ranks panel shows both; q (and its
    confirmation) stops both ranks, whose scripts go on after fit; the exit code is torchrun's, 0; no
    rank is left; the flags reached the ranks (each writes its metrics file)."""
    run = launch(processes, env, tmp_path, "--metrics", "m.jsonl", ())
    run.wait_shown("rank 0 of 2", "ranks · 2 in the job", "rank 1 ", timeout=120)
    ranks = [int(p.name.split(".")[0]) for p in (tmp_path / "run" / "gputui").glob("*.sock")]
    processes.adopt(*ranks)  # in sessions of their own: ended with the test, whatever becomes of torchrun
    assert len(ranks) == 2, ranks
    run.send(b"q")
    run.wait_shown("Stop after the current step and quit?")
    run.send(b"y")
    assert run.exit_code(timeout=90) == 0, run.text(3000)
    screen = run.text(len(run.screen))
    log = Path(re.search(r"their output goes to (\S+\.log)", screen)[1])
    assert log.parent == tmp_path
    text = log.read_text()
    stops = re.findall(r"after fit: rank (\d) of 2 stopped interrupted at step (\d+)", text)
    assert sorted(r for r, _ in stops) == ["0", "1"] and stops[0][1] == stops[1][1], text[-3000:]
    assert f"output, every rank's: {log}" in screen, "the log is named when the TUI ends"
    for name in ("m.jsonl", "m.rank1.jsonl"):
        end = json.loads((tmp_path / name).read_text().splitlines()[-1])
        assert (end["kind"], end["stopped"], end["steps"]) == ("end", "interrupted", int(stops[0][1])), name
    wait_until(
        lambda: not [r for r in ranks if psutil.pid_exists(r)], 10, lambda: f"ranks left running: {ranks}", every=0.1
    )


def test_a_job_that_ends_on_its_own_is_shown_ended_and_gives_its_exit_code(env, tmp_path, processes):
    """Both ranks train 5 steps, then rank 1 exits 3: torchrun reports the failure (1), the TUI shows it
    with the log's last lines, and q leaves with torchrun's code."""
    run = launch(processes, env, tmp_path, ("5",))
    run.wait_shown("rank 0 of 2", "torchrun ended with exit code 1", "Root Cause", timeout=120)
    run.send(b"q")
    assert run.exit_code(timeout=90) == 1
    log = Path(re.search(r"their output goes to (\S+\.log)", run.text(len(run.screen)))[1]).read_text()
    assert "after fit: rank 0 of 2 stopped None at step 5" in log and "exitcode  : 3" in log, log[-3000:]


def test_q_while_a_rank_is_stalled_ends_the_job_with_the_rank_named_and_the_save(env, tmp_path, processes):
    """Rank 1 stops answering (SIGSTOP): rank 0's screen says it waits for rank 1; q (confirmed) ends
    rank 0's wait at once with a FitError naming rank 1, after which its script's save runs; the job
    ends, bounded (the stopped rank is killed after the TUI's grace)."""
    run = launch(
        processes, env | {"STALL": "1", "GPUTUI_RANK_WAITING_S": "1", "GPUTUI_KILL_AFTER_S": "3"}, tmp_path, ()
    )
    run.wait_shown("waiting for rank 1 since step 4", timeout=120)
    ranks = [int(p.name.split(".")[0]) for p in (tmp_path / "run" / "gputui").glob("*.sock")]
    processes.adopt(*ranks)
    run.send(b"q")
    run.wait_shown("Stop after the current step and quit?")
    run.send(b"y")
    assert run.exit_code(timeout=90) != 0
    log = Path(re.search(r"their output goes to (\S+\.log)", run.text(len(run.screen)))[1]).read_text()
    said = "rank 0 stopped (interrupted) while waiting for rank 1, which stopped answering at step 4"
    assert said in log, log[-3000:]
    assert (tmp_path / "saved.0").exists() and not (tmp_path / "saved.1").exists()
