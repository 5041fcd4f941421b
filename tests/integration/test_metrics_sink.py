"""A metrics file that can take no more (a full disk): training goes on, the file keeps whole
lines only, one line on stderr says so, and the exit code is the training's."""

import json
import os
import resource
import textwrap
from pathlib import Path

import pytest
from process import python

ROOT = Path(__file__).resolve().parents[2]

TRAIN = """
import sys
import gputui
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2))
data = [(torch.randn(8, 16), torch.randint(2, (8,))) for _ in range(20)]
result = gputui.fit(model, data, lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]),
                    torch.optim.SGD(model.parameters(), lr=0.1), metrics=sys.argv[1] if len(sys.argv) > 1 else None)
print("trained", result.steps)
"""


def run(args, tmp_path, limit=None):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(TRAIN))

    def small_disk():  # a disk that fills: writes past `limit` bytes fail (EFBIG; Python ignores SIGXFSZ)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": str(ROOT)}
    return python(*args(script), cwd=tmp_path, env=env, preexec_fn=small_disk if limit else None)


def test_a_disk_that_fills_mid_line_leaves_only_whole_lines(tmp_path):
    path = tmp_path / "m.jsonl"
    done = run(lambda script: [script, path], tmp_path, limit=3000)  # plain `python train.py`
    assert done.returncode == 0, done.stderr
    assert "trained 20" in done.stdout
    assert done.stderr == f"gputui: metrics file {path}: File too large; no more lines will be written\n"
    text = path.read_text()
    assert text.endswith("\n") and 0 < len(text) <= 3000
    lines = [json.loads(line) for line in text.splitlines()]  # every line whole
    assert lines[0]["kind"] == "start" and lines[-1]["kind"] == "step"


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_gputui_run_with_metrics_on_a_full_device_exits_with_the_training_code(tmp_path):
    done = run(lambda script: ["-m", "gputui", "run", "--headless", "--metrics", "/dev/full", script], tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stderr == "gputui: metrics file /dev/full: No space left on device; no more lines will be written\n"
    assert "trained 20" in done.stdout and "gputui: done: 20 steps" in done.stdout
