"""A rank that stops answering (SIGSTOP) under torchrun: the other says it waits, and ends bounded
with a FitError naming it, at rank_timeout or at once on a Ctrl-C, its script's save done. Every
launch is bounded; the stopped rank is killed by the test."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest
from process import wait_until

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import json, os, signal, sys, time
import torch
from torch import nn
import gputui
from gputui.telemetry.hub import Sink
from gputui.telemetry.setup import for_process

out = sys.argv[1]
rank = int(os.environ["RANK"])


class Stall(Sink):
    def on_sample(self, sample):
        if rank == 1 and sample.step == 3 and not inside:  # rank 1 stops answering after its step 3
            os.kill(os.getpid(), signal.SIGSTOP)

    def on_event(self, event):
        if event.name == "rank_waiting":
            with open(os.path.join(out, f"waiting.{rank}"), "a") as f:
                f.write(json.dumps({"step": event.step, **event.details}) + "\\n")


inside = os.environ.get("INSIDE") == "1"  # rank 1 stops inside step 4's forward instead
calls = []


def step(model, batch):
    calls.append(1)
    if rank == 1 and inside and len(calls) == 4:  # its exchange done: rank 0 waits in DDP's backward
        time.sleep(1)
        os.kill(os.getpid(), signal.SIGSTOP)
    return nn.functional.mse_loss(model(batch[0]), batch[1])


hub = for_process(sys.stdout)  # the hub fit will use (with its progress line)
hub.add_sink(Stall())
with open(os.path.join(out, f"pid.{rank}"), "w") as f:
    f.write(str(os.getpid()))
torch.manual_seed(0)
model = nn.Linear(4, 1)
data = [(torch.randn(4, 4), torch.randn(4, 1)) for _ in range(1000)]
record = {}
try:
    gputui.fit(model, data, step, torch.optim.SGD(model.parameters()), rank_timeout=float(os.environ["RANK_TIMEOUT"]))
except gputui.FitError as exc:
    record["error"] = str(exc)
finally:  # the script's own save
    torch.save(model.state_dict(), os.path.join(out, f"saved.{rank}.pt"))
    with open(os.path.join(out, f"record.{rank}.json"), "w") as f:
        json.dump(record, f)
"""


def until(check, what: str, limit_s: float = 60) -> None:
    wait_until(check, limit_s, what, every=0.1)


def ended(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def said(path: Path) -> str:
    """A file's whole lines so far (a rank appends to it as we read)."""
    text = path.read_text() if path.exists() else ""
    return text[: text.rfind("\n") + 1]


@pytest.fixture
def launched(tmp_path: Path, processes) -> Any:
    """Start a launch with the given rank_timeout; torchrun and both ranks end with the test (processes)."""

    def launch(rank_timeout: float, inside: bool = False) -> tuple[Path, Path]:
        (tmp_path / "script.py").write_text(SCRIPT)
        out = tmp_path / "out"
        out.mkdir()
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(ROOT),
            "RANK_TIMEOUT": str(rank_timeout),
            "GPUTUI_RANK_WAITING_S": "1",
            "INSIDE": "1" if inside else "0",
        }
        log = tmp_path / "log.txt"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
        with open(log, "wb") as f:
            processes.start(
                [*command, tmp_path / "script.py", out], env=env, cwd=tmp_path, stdout=f, stderr=subprocess.STDOUT
            )
        until(lambda: said(out / "waiting.0"), "rank 0 says it waits")
        return out, log

    return launch


def pid(out: Path, rank: int) -> int:
    return int((out / f"pid.{rank}").read_text())


def test_a_stalled_rank_is_said_and_ends_the_others_at_rank_timeout(launched):
    out, log = launched(rank_timeout=6)
    waiting = json.loads(said(out / "waiting.0").splitlines()[0])
    assert (waiting["ranks"], waiting["at"]) == ([1], 4), waiting
    until(lambda: ended(pid(out, 0)), "rank 0 ends at its rank_timeout")
    error = json.loads((out / "record.0.json").read_text())["error"]
    assert error.startswith("rank 1 stopped answering: rank 0 waited "), error
    assert "at step 4 (rank_timeout=6)" in error, error
    assert (out / "saved.0.pt").exists()
    assert "waiting for rank 1 since step 4" in log.read_text()  # rank 0's progress line
    assert not ended(pid(out, 1))  # still stopped: it never answered


def test_a_ctrl_c_ends_the_wait_at_once_with_the_save(launched):
    """rank_timeout is far away (100 s): only the SIGINT can have ended the wait."""
    out, _ = launched(rank_timeout=100)
    os.kill(pid(out, 0), signal.SIGINT)
    until(lambda: ended(pid(out, 0)), "rank 0 ends on its SIGINT", limit_s=30)
    error = json.loads((out / "record.0.json").read_text())["error"]
    assert error.startswith("rank 0 stopped (interrupted) while waiting for rank 1, which stopped answering at step 4")
    assert (out / "saved.0.pt").exists()


def test_a_rank_stalled_inside_its_step_is_said_and_a_ctrl_c_heard(launched):
    """Rank 1 stops inside step 4's forward: rank 0 waits for it in DDP's gradient all-reduce, in
    slices (fit's comm hook waits for the step's last bucket), so the wait is said as at an exchange
    and a Ctrl-C ends it at once, with the save."""
    out, log = launched(rank_timeout=100, inside=True)
    until(lambda: said(out / "waiting.0"), "rank 0 says it waits")
    waiting = json.loads(said(out / "waiting.0").splitlines()[0])
    assert (waiting["ranks"], waiting["at"]) == ([1], 4), waiting
    os.kill(pid(out, 0), signal.SIGINT)
    until(lambda: ended(pid(out, 0)), "rank 0 ends on its SIGINT", limit_s=30)
    error = json.loads((out / "record.0.json").read_text())["error"]
    assert error.startswith("rank 0 stopped (interrupted) while waiting for rank 1, which stopped answering at step 4")
    assert (out / "saved.0.pt").exists()
