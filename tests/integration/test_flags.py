"""Every `gputui run` flag means the same for a fit() script and for a script with its own loop.

The command-line settings reach both through one place (engine/session.py): these tests run the
same tiny model both ways with each flag and compare what the run recorded.
"""

import json
import os
import signal
import subprocess
import textwrap

import pytest
from process import gputui, wait_until

from gputui import launch
from gputui.probes import snapshot
from gputui.telemetry.hub import Overrides
from gputui.telemetry.setup import opened

PRELUDE = """
import torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x, y = torch.randn(64, 8), torch.randint(2, (64,))
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)
"""

SCRIPTS = {
    "fit": PRELUDE
    + """
import gputui  # on the CPU, as the own loop trains: the same device either way, GPU or not
print("fit starts")  # the optimizer above was made while the model is on the CPU, as scripts do
gputui.fit(model, loader, lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]), opt, device="cpu")
""",
    "own_loop": PRELUDE
    + """
for xb, yb in loader:
    opt.zero_grad()
    nn.functional.cross_entropy(model(xb), yb).backward()
    opt.step()
""",
}
MODES = {"fit": "fit", "own_loop": "observe"}


def run(tmp_path, mode: str, *flags: str) -> subprocess.CompletedProcess:
    script = tmp_path / f"{mode}.py"
    script.write_text(textwrap.dedent(SCRIPTS[mode]))
    return gputui("run", "--headless", *flags, script, cwd=tmp_path, env={**os.environ, "GPUTUI_NO_SOCKET": "1"})


def records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("mode", SCRIPTS)
def test_metrics_and_memory_budget(tmp_path, mode):
    done = run(tmp_path, mode, "--metrics", "m.jsonl", "--memory-budget", "64MiB")
    assert done.returncode == 0, done.stderr
    lines = records(tmp_path / "m.jsonl")
    start, steps, end = lines[0], [r for r in lines if r["kind"] == "step"], lines[-1]
    assert start["kind"] == "start" and start["mode"] == MODES[mode]
    assert start["memory_budget"] == 64 * 2**20
    assert len(steps) == 4 and {s["memory"]["capacity"] for s in steps} == {64 * 2**20}
    assert end["kind"] == "end" and end["steps"] == 4 and end["error"] is None


@pytest.mark.parametrize("mode", SCRIPTS)
def test_a_memory_budget_too_small_fails_the_first_step_either_way(tmp_path, mode):
    done = run(tmp_path, mode, "--metrics", "m.jsonl", "--memory-budget", "1KiB")
    assert done.returncode == 1
    # fit says why in one line; an own loop's OOM ends the script, with gputui's diagnosis after it
    said = "is smaller than the model's parameters" if mode == "fit" else "gputui: out of memory in forward"
    assert said in done.stderr
    end = records(tmp_path / "m.jsonl")[-1]
    assert end["kind"] == "end" and end["steps"] == 0 and end["error"]


@pytest.mark.parametrize("mode", SCRIPTS)
def test_gpu_memory_limit_without_cuda_is_the_same_one_line_error(tmp_path, mode):
    done = run(tmp_path, mode, "--gpu-memory-limit", "1GiB")
    assert done.returncode == 1
    # a fit script is not stopped at its optimizer (fit may yet move the model to a GPU): fit says it
    assert ("fit starts" in done.stdout) == (mode == "fit")
    assert "gpu_memory_limit needs a CUDA device, not cpu" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("mode", SCRIPTS)
def test_memory_history_on_a_device_without_it_changes_nothing(tmp_path, mode):
    done = run(tmp_path, mode, "--memory-history", "--metrics", "m.jsonl")
    assert done.returncode == 0, done.stderr
    assert records(tmp_path / "m.jsonl")[-1]["steps"] == 4
    assert not (tmp_path / "gputui-snapshots").exists()


@pytest.mark.parametrize("mode", SCRIPTS)
def test_snapshot_dir_and_memory_history_reach_both_loops(tmp_path, monkeypatch, mode):
    """CUDA snapshots, stood in for on this CPU: the folder a requested snapshot lands in, and the
    history recorded from the start, are the command line's in both modes."""
    started = []
    monkeypatch.setattr(snapshot, "unavailable", lambda device: None)
    monkeypatch.setattr(snapshot, "start_history", lambda owner: started.append(owner))
    monkeypatch.setattr(
        snapshot,
        "dump",
        lambda folder, device, *, step, reason: {
            "path": os.path.join(folder, "s.pickle"),
            "summary_path": "",
            "history": True,
            "reason": reason,
        },
    )
    script = tmp_path / f"{mode}.py"
    script.write_text(textwrap.dedent(SCRIPTS[mode]))
    monkeypatch.chdir(tmp_path)
    overrides = Overrides(snapshot_dir=str(tmp_path / "snaps"), memory_history=True)
    with opened(overrides, attachable=False) as hub:
        hub.controls.request("snapshot")  # applied at the first step boundary
        assert launch.run_script(str(script), [], observe=hub) == 0
    saved = [e for e in hub.events() if e.name == "snapshot_saved"]
    assert [e["path"] for e in saved] == [str(tmp_path / "snaps" / "s.pickle")]
    assert started, "--memory-history did not start recording"
    assert hub.info is not None and hub.info.mode == MODES[mode] and "snapshot" not in hub.info.refused


@pytest.mark.parametrize("mode", SCRIPTS)
def test_a_stop_request_ends_either_run_as_stopped_not_failed(tmp_path, monkeypatch, mode):
    from helpers import RequestAt

    script = tmp_path / f"{mode}.py"
    script.write_text(textwrap.dedent(SCRIPTS[mode]))
    monkeypatch.chdir(tmp_path)
    with opened(attachable=False) as hub:
        hub.add_sink(RequestAt(hub, 2, "stop"))
        code = launch.run_script(str(script), [], observe=hub)
    # fit returns after the step (the script goes on to its end); an own loop gets Ctrl-C's KeyboardInterrupt
    assert code == (0 if mode == "fit" else 130)
    summary = hub.summary
    assert summary is not None and summary.steps == 2
    assert summary.stopped and summary.stopped.startswith("requested") and summary.error is None
    assert summary.outcome == "stopped"


def training_own_loop(folder, processes, env):
    """`gputui run --headless` on a script with its own loop that trains for minutes, once its first step
    is in the metrics file: stopped by the test. Returns the process and the metrics file."""
    script, metrics = folder / "long.py", folder / "m.jsonl"
    script.write_text(
        textwrap.dedent(PRELUDE)
        + "import time\nfor epoch in range(1000):\n    for xb, yb in loader:\n        opt.zero_grad()\n"
        "        nn.functional.cross_entropy(model(xb), yb).backward()\n        opt.step()\n        time.sleep(0.01)\n"
    )
    proc = processes.gputui(
        "run",
        "--headless",
        "--metrics",
        metrics,
        script,
        cwd=folder,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_until(lambda: metrics.exists() and '"kind":"step"' in metrics.read_text(), message="no step", process=proc)
    return proc, metrics


def test_sigterm_to_a_headless_own_loop_finishes_the_step_and_ends_the_run(tmp_path, processes):
    """As under the TUI: the loop stops at its next boundary, the end record is written (it was killed
    at once, with no end record and its socket left behind)."""
    proc, metrics = training_own_loop(tmp_path, processes, {**os.environ, "GPUTUI_NO_SOCKET": "1"})
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "terminated: finishing the current step" in err
    end = records(metrics)[-1]
    assert end["kind"] == "end" and end["stopped"] == "terminated" and end["error"] is None


def test_a_ctrl_c_while_torch_loads_is_one_line_not_our_traceback(tmp_path, monkeypatch, capsys):
    """The watcher imports torch before the script runs (seconds on a slow machine): a Ctrl-C then was a
    traceback through gputui's and torch's imports."""
    script = tmp_path / "train.py"
    script.write_text("print('never')\n")

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(launch, "_observed", interrupted)
    with opened(attachable=False) as hub:
        code = launch.run_script(str(script), [], observe=hub)
    out, err = capsys.readouterr()
    assert code == 130 and err == "\ngputui: train.py interrupted before it started\n" and out == ""


@pytest.mark.process
@pytest.mark.parametrize("how", ["ctrl-c", "ctl stop"])
def test_a_headless_own_loop_ended_by_ctrl_c_dies_by_sigint_and_one_stopped_by_request_exits_130(
    tmp_path, processes, how
):
    """Python ends on a Ctrl-C it did not catch by SIGINT, so a shell loop over runs stops too; a stop asked
    with `gputui ctl` (or a q) is no Ctrl-C: the shell's loop goes on to its next run."""
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    env = {**os.environ, "XDG_RUNTIME_DIR": str(runtime)}
    proc, metrics = training_own_loop(tmp_path, processes, env)
    if how == "ctrl-c":
        proc.send_signal(signal.SIGINT)
    else:
        assert gputui("ctl", str(proc.pid), "stop", env=env).returncode == 0
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == (-signal.SIGINT if how == "ctrl-c" else 130), err
    end = records(metrics)[-1]
    assert end["kind"] == "end" and end["stopped"] == ("interrupted" if how == "ctrl-c" else "requested")
