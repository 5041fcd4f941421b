"""demos/train_gpt.py as a user runs it: headless under gputui, then resumed under plain python, then stopped
by a Ctrl-C and saved. The step count goes on from the checkpoint, which torch.load(weights_only=True)
reads, and the evaluations are logged."""

import json
import signal
import subprocess
from pathlib import Path

import torch
from process import gputui, python, wait_until

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "demos" / "train_gpt.py"
TINY = ["--width", "32", "--layers", "2", "--heads", "2", "--seq", "32", "--batch", "8", "--eval-batches", "2"]
TINY += ["--eval-interval", "2", "--log-interval", "1"]


def records(path: Path, kind: str) -> list[dict]:
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["kind"] == kind]


def test_trains_headless_then_resumes_from_its_checkpoint(tmp_path):
    out, metrics = tmp_path / "out", tmp_path / "m.jsonl"
    first = gputui(
        "run", "--headless", "--metrics", metrics, DEMO, *TINY, "--steps", "4", "--out", out, "--micro-batch", "3"
    )
    assert first.returncode == 0, first.stderr
    assert [r["step"] for r in records(metrics, "step")] == [1, 2, 3, 4]
    assert [e["step"] for e in records(metrics, "event") if e["name"] == "eval"] == [2, 4]
    assert "step 4: val loss " in first.stdout and "step 4: saved " in first.stdout
    saved = torch.load(out / "ckpt.pt", weights_only=True)
    assert saved["step"] == 4 and saved["trainer"]["steps"] == 4 and saved["trainer"]["micro_batch"] == 3

    resumed = python(DEMO, *TINY, "--steps", "6", "--out", out, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from " in resumed.stdout and " at step 4" in resumed.stdout
    logged = [line.split(":")[0] for line in resumed.stdout.splitlines() if ": loss " in line]
    assert logged == ["step 5/6", "step 6/6"], "the step count goes on from the checkpoint's"
    assert "step 6: val loss " in resumed.stdout
    saved = torch.load(out / "ckpt.pt", weights_only=True)
    assert saved["step"] == 6 and saved["scheduler"]["last_epoch"] == 6
    assert saved["trainer"]["micro_batch"] == 3, "the micro-batch the run had goes on"


def test_a_ctrl_c_finishes_the_step_and_saves_it(tmp_path, processes):
    out, metrics = tmp_path / "out", tmp_path / "m.jsonl"
    job = processes.gputui(
        "run",
        "--headless",
        "--metrics",
        metrics,
        DEMO,
        *TINY,
        "--steps",
        "100000",
        "--out",
        out,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_until(lambda: metrics.exists() and records(metrics, "step"), timeout=90, process=job)
    job.send_signal(signal.SIGINT)
    stdout, stderr = job.communicate(timeout=90)
    assert job.returncode == 0, stderr
    last = records(metrics, "step")[-1]["step"]
    assert f"step {last}: stopping (interrupted)" in stdout
    assert torch.load(out / "ckpt.pt", weights_only=True)["step"] == last, "saved at the step it stopped after"
