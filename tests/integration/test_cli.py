"""`gputui run --headless` on real scripts in real processes: arguments, exit codes, errors, signals."""

import json
import os
import signal
import subprocess
import textwrap
from pathlib import Path

import pytest
from process import gputui, python, wait_steps

ROOT = Path(__file__).resolve().parents[2]

TRAIN = """
import sys, time
import gputui
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 2))
data = [(torch.randn(32, 16), torch.randint(2, (32,))) for _ in range({batches})]
delay = {delay}

def step(model, batch):
    time.sleep(delay)
    return nn.functional.cross_entropy(model(batch[0]), batch[1])

result = gputui.fit(model, data, step, torch.optim.SGD(model.parameters(), lr=0.1), {extra})
gputui.save({{"steps": result.steps, "stopped": result.stopped}}, sys.argv[1])
print("saved", result.steps, result.stopped)
"""


def script(tmp_path, text, name="train.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_script_sees_its_args_and_its_exit_code_comes_back(tmp_path):
    path = script(
        tmp_path,
        """
        import os, sys
        print("argv", sys.argv[1:], os.path.basename(sys.argv[0]), __name__)
        sys.exit(3)
    """,
    )
    done = gputui("run", "--headless", path, "--lr", "0.1", "-x", "pos", cwd=tmp_path)
    assert done.returncode == 3
    assert done.stdout.strip() == "argv ['--lr', '0.1', '-x', 'pos'] train.py __main__"


def test_a_script_that_raises_gets_its_traceback_without_ours(tmp_path):
    path = script(
        tmp_path,
        """
        def helper():
            return 1 / 0
        helper()
    """,
        "bad.py",
    )
    done = gputui("run", "--headless", path)
    assert done.returncode == 1
    assert done.stderr.splitlines()[-1] == "gputui: bad.py failed: ZeroDivisionError: division by zero"
    assert 'bad.py", line 3, in helper' in done.stderr
    assert "runpy" not in done.stderr and "launch.py" not in done.stderr


@pytest.mark.parametrize(
    "args, code, message",
    [
        (["run", "--headless", "missing.py"], 2, "gputui: error: no such script: missing.py"),
        (["run", "--headless", "--memory-budget", "lots", "x.py"], 2, "not a size: 'lots'"),
        (["run", "--headless", "."], 2, "gputui: error: . is a directory, not a Python script"),
        *(  # refused before anything is sent: a control sent with a wait that cannot be waited is applied unsaid
            (
                ["ctl", "1", "pause", "--timeout", t],
                2,
                f"--timeout takes seconds above 0, up to 86400 (a day), not '{t}'",
            )
            for t in ("1e400", "-1", "0", "nan")
        ),
    ],
)
def test_bad_command_lines(tmp_path, args, code, message):
    done = gputui(*args, cwd=tmp_path)
    assert done.returncode == code and message in done.stderr
    assert "Traceback" not in done.stderr


def test_syntax_error_is_one_line(tmp_path):
    path = script(tmp_path, "def broken(:\n    pass\n", "syn.py")
    done = gputui("run", "--headless", path)
    assert done.returncode == 1
    assert done.stderr.strip().startswith("gputui: syn.py has a syntax error at ")
    assert len(done.stderr.strip().splitlines()) == 1


def test_metrics_and_budget_from_the_command_line_win(tmp_path):
    path = script(tmp_path, TRAIN.format(batches=4, delay=0, extra="memory_budget='1GiB'"))
    metrics = tmp_path / "m.jsonl"
    done = gputui("run", "--headless", "--metrics", metrics, "--memory-budget", "16KiB", path, tmp_path / "out.pt")
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert lines[0]["kind"] == "start" and lines[0]["memory_budget"] == 16 * 1024
    assert [x["step"] for x in lines if x["kind"] == "step"] == [1, 2, 3, 4]
    recovered = [x for x in lines if x.get("name") == "oom_recovered"]
    assert recovered and recovered[0]["micro_batch"] == 32
    assert "OOM in " in done.stdout and "saved 4 None" in done.stdout


def test_fit_error_is_one_line_and_fails(tmp_path):
    path = script(tmp_path, TRAIN.format(batches=2, delay=0, extra=""))
    done = gputui("run", "--headless", "--memory-budget", "6KiB", path, tmp_path / "out.pt")
    assert done.returncode == 1
    assert done.stderr.startswith("gputui: error: out of memory in ") and "micro-batch 1" in done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "out.pt").exists()
    done = gputui("run", "--headless", "--memory-budget", "1KiB", path, tmp_path / "out.pt")
    assert done.returncode == 1 and done.stderr.strip() == (
        "gputui: error: the memory budget (1.00 KiB) is smaller than the model's parameters and optimizer "
        "state (4.76 KiB): no batch can fit"
    )


@pytest.mark.parametrize("sig, reason", [(signal.SIGINT, "interrupted"), (signal.SIGTERM, "terminated")])
def test_signal_finishes_the_step_and_the_script_saves(tmp_path, env, processes, sig, reason):
    path = script(tmp_path, TRAIN.format(batches=10_000, delay=0.02, extra=""))
    out = tmp_path / "out.pt"
    proc = processes.gputui(
        "run", "--headless", path, out, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    line = proc.stdout.readline()  # the header: training has started
    assert line.startswith("gputui: training"), line
    wait_steps(env, proc.pid, 1)
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    assert f"{reason}: finishing the current step" in stderr
    assert f"stopped ({reason})" in stdout
    import torch  # only to read the file the script wrote

    from gputui.units import format_bytes

    saved = torch.load(out)
    assert saved["stopped"] == reason and saved["steps"] > 0
    assert f"gputui: stopped ({reason}): {saved['steps']} steps, " in stdout, "the run's end line says why"
    assert stdout.splitlines()[-1] == f"gputui: saved {out} ({format_bytes(out.stat().st_size)})", "once it ended"


@pytest.mark.parametrize("demo, extra", [("mlp.py", []), ("gpt.py", ["--batch", "4"])])
def test_demos_run_headless(tmp_path, demo, extra):
    metrics = tmp_path / "m.jsonl"
    done = gputui(
        "run",
        "--headless",
        "--metrics",
        metrics,
        ROOT / "demos" / demo,
        "--size",
        "tiny",
        "--steps",
        "6",
        *extra,
        "--save",
        tmp_path / "model.pt",
    )
    assert done.returncode == 0, done.stderr
    assert "gputui: done: 6 steps" in done.stdout and (tmp_path / "model.pt").exists()
    steps = [json.loads(x) for x in metrics.read_text().splitlines() if '"kind":"step"' in x]
    assert len(steps) == 6 and steps[-1]["loss"] < steps[0]["loss"] * 1.5


def test_plain_python_trains_with_a_progress_line(tmp_path):
    done = python(ROOT / "demos" / "mlp.py", "--size", "tiny", "--steps", "3")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0].startswith("gputui: training MLP")
    assert "gputui: done: 3 steps" in done.stdout


def test_a_reader_that_closes_the_pipe_gets_no_traceback(tmp_path):
    """`gputui jobs | head -1`: the pipe closes before gputui has written; it exits without a traceback."""
    read, write = os.pipe()
    os.close(read)
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path)}
    done = gputui("jobs", stdout=write, env=env)
    os.close(write)
    assert done.returncode == 1 and done.stderr == ""


def test_two_fit_calls_are_one_run_in_the_metrics_file(tmp_path):
    path = script(
        tmp_path,
        """
        import gputui, torch
        from torch import nn

        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        data = [(torch.randn(8, 16), torch.randint(2, (8,))) for _ in range(3)]

        def step(model, batch):
            return nn.functional.cross_entropy(model(batch[0]), batch[1])

        first = gputui.fit(model, data, step, opt)
        print("evaluating between the calls")
        second = gputui.fit(model, data[:2], step, opt)
        print("calls", first.steps, second.steps)
    """,
    )
    metrics = tmp_path / "m.jsonl"
    done = gputui("run", "--headless", "--metrics", metrics, path)
    assert done.returncode == 0, done.stderr
    assert "calls 3 2" in done.stdout and "step 5/5 |" in done.stdout
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    kinds = [x["kind"] for x in lines]
    assert kinds.count("start") == 1 and kinds[0] == "start" and lines[0]["total_steps"] == 3
    assert [x["step"] for x in lines if x["kind"] == "step"] == [1, 2, 3, 4, 5]
    (continued,) = [x for x in lines if x.get("name") == "run_continued"]
    assert continued["total_steps"] == 5 and continued["step"] == 3
    assert kinds.count("end") == 1 and kinds[-1] == "end"
    assert (lines[-1]["steps"], lines[-1]["samples"], lines[-1]["error"]) == (5, 40, None)
