"""Jobs, attach, ctl and bad clients, with real processes over real sockets."""

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest
from process import gputui, screens, socket_of, wait_steps, wait_until

from gputui.telemetry.client import Connection
from gputui.telemetry.protocol import encode

SCRIPT = """
import sys, time
import gputui, torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))
data = [(torch.randn(16, 8), torch.randint(2, (16,))) for _ in range(100)]

def step(model, batch):
    time.sleep(0.02)
    return nn.functional.cross_entropy(model(batch[0]), batch[1])

result = gputui.fit(model, data, step, torch.optim.SGD(model.parameters(), lr=0.1), max_steps=100_000)
gputui.save({"steps": result.steps, "stopped": result.stopped}, sys.argv[1])
"""


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(SCRIPT))
    return path


def step_of(env, pid):
    done = gputui("attach", pid, "--json", env=env)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout).get("step")


@pytest.fixture
def job(env, script, tmp_path, processes):
    """A headless job two steps in; it has no end of its own (ended with the test, if not before)."""
    metrics = tmp_path / "m.jsonl"
    proc = processes.gputui(
        "run",
        "--headless",
        "--metrics",
        metrics,
        script,
        tmp_path / "out.pt",
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_steps(env, proc.pid, 2)
    return proc


def test_jobs_attach_json_and_ctl(env, job, tmp_path):
    listed = json.loads(gputui("jobs", "--json", env=env).stdout)
    assert [(j["pid"], j["script"], j["device"], j["state"]) for j in listed] == [
        (job.pid, "train.py", "cpu", "training")
    ]
    text = gputui("jobs", env=env).stdout.splitlines()
    assert text[0].split()[:3] == ["PID", "SCRIPT", "DEVICE"] and str(job.pid) in text[1]

    done = gputui("ctl", job.pid, "halve-batch", env=env)
    assert done.returncode == 0, done.stderr
    assert f"job {job.pid}: after step" in done.stdout and "micro-batch 16 -> 8 (accumulation 2)" in done.stdout
    assert gputui("ctl", job.pid, "halve-batch", env=env).returncode == 0
    done = gputui("ctl", job.pid, "checkpointing", "on", env=env)
    assert done.returncode == 1 and "not applied, no repeated blocks found" in done.stdout
    done = gputui("ctl", job.pid, "amp", "fp8", env=env)
    assert done.returncode == 1 and done.stderr == "gputui: error: amp takes one of off, bf16, fp16\n"

    done = gputui("ctl", job.pid, "stop", env=env)
    assert done.returncode == 0 and "stop requested" in done.stdout
    assert job.wait(timeout=30) == 0
    lines = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    changes = [x for x in lines if x.get("name") == "micro_batch_changed"]
    assert [(c["from"], c["to"], c["source"].startswith("attach pid")) for c in changes] == [
        (16, 8, True),
        (8, 4, True),
    ]
    assert lines[-1]["kind"] == "end" and lines[-1]["stopped"] == "requested"
    assert not os.path.exists(os.path.join(env["XDG_RUNTIME_DIR"], "gputui", f"{job.pid}.sock"))


def test_hostile_clients_cannot_stop_or_slow_the_job(env, job):
    path = socket_of(env, job.pid)
    clients = []
    for payload in (
        b"garbage\n" * 50,
        b'{"v": 3, "kind": "control", "id": 1, "action": "stop"}\n',
        b'{"v": 3, "kind": "hel',
        b"A" * 20_000,
        b"\xff" * 100 + b"\n",
        b"[" * 2000 + b"\n",
    ):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)
        s.sendall(payload)
        clients.append(s)  # and never read: each is dropped or ignored, never waited for
    wait_steps(env, job.pid, step_of(env, job.pid) + 6)  # the job keeps training
    done = gputui("ctl", job.pid, "pause", env=env)
    assert done.returncode == 0 and "paused" in done.stdout, "and stay steerable"
    assert job.poll() is None, "a watch-only client's stop must not have stopped it"
    with Connection(path, control=True) as flood:  # 50 heap walks asked at once: only a few are taken
        flood.welcome()
        flood.sock.sendall(b"".join(encode({"kind": "control", "id": i, "action": "top_tensors"}) for i in range(50)))
        replies = []
        while len(replies) < 50:
            record = flood.read()
            if record["kind"] in ("ack", "error") and "id" in record:
                replies.append(record)
    assert 1 <= sum(r["kind"] == "ack" for r in replies) <= 4
    assert all("waiting for the job to apply them" in r["reason"] for r in replies if r["kind"] == "error")
    for s in clients:
        s.close()
    assert gputui("ctl", job.pid, "resume", env=env).returncode == 0
    assert gputui("ctl", job.pid, "stop", env=env).returncode == 0
    _, err = job.communicate(timeout=30)
    assert "telemetry server error" not in err and "Traceback" not in err, err


def test_sigkill_leaves_a_stale_socket_that_jobs_cleans(env, job):
    path = socket_of(env, job.pid)
    job.kill()
    job.wait(timeout=30)
    assert os.path.exists(path)  # SIGKILL gave it no chance to clean up
    assert gputui("jobs", env=env).stdout.startswith("no running gputui jobs")
    assert not os.path.exists(path)
    done = gputui("attach", job.pid, "--json", env=env)
    assert done.returncode == 1 and "is not running" in done.stderr


def test_plain_python_scripts_are_attachable_too(env, script, tmp_path, processes):
    proc = processes.start(
        [sys.executable, script, tmp_path / "out.pt"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_steps(env, proc.pid, 1)
    assert gputui("ctl", proc.pid, "stop", env=env).returncode == 0
    assert proc.wait(timeout=30) == 0


ENDS = """
import os, sys, time
import gputui, torch
from gputui.telemetry.hub import current

mode = sys.argv[1]

def step(model, batch):  # the one step ends once a control is queued: no boundary comes to apply it
    if mode != "lingers":
        open(sys.argv[2], "w").close()  # past the first boundary: ready for the request
        while not len(current().controls):
            time.sleep(0.01)
    if mode == "dies":
        os._exit(0)
    return model(batch).square().mean()

model = torch.nn.Linear(8, 2)
gputui.fit(model, [torch.randn(4, 8)], step, torch.optim.SGD(model.parameters(), lr=0.1))
if mode == "lingers":  # the run is over, the script goes on (evaluating, saving)
    open(sys.argv[2], "w").close()
    time.sleep(600)
"""


@pytest.mark.parametrize(
    "mode, said",
    [
        ("ends", "job {pid}: its run ended before applying it (finished, after step 1)"),
        ("dies", "job {pid} ended before applying it (the connection closed without its final record)"),
        (
            "lingers",
            "job {pid}: between steps (after step 1, {idle} s outside a step): "
            "requested; it applies when training resumes",
        ),
    ],
)
def test_ctl_says_the_job_ended_before_applying_it(env, tmp_path, processes, mode, said):
    path, ready = tmp_path / "ends.py", tmp_path / "ready"
    path.write_text(ENDS)
    proc = processes.gputui(
        "run", "--headless", path, mode, ready, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    wait_until(ready.exists, message="the script never got to its step", process=proc)  # the socket is up before
    done = gputui("ctl", proc.pid, "halve-batch", env=env)
    before, _, after = said.format(pid=proc.pid, idle="{idle}").partition("{idle}")  # seconds vary
    assert done.returncode == 1, done.stderr
    assert done.stdout.startswith(before) and done.stdout.endswith(after + "\n"), done.stdout


def test_attach_needs_a_job(env):
    done = gputui("attach", env=env)
    assert done.returncode == 1 and done.stderr.startswith("gputui: error: no running gputui jobs of yours")
    done = gputui("ctl", "999999", "pause", env=env)
    assert done.returncode == 1 and "process 999999 is not running" in done.stderr


def test_the_tui_survives_its_terminal_closing(env, script, tmp_path, processes):
    out = tmp_path / "out.pt"
    run = processes.terminal([sys.executable, "-m", "gputui", "run", script, out], env)  # as over SSH
    wait_steps(env, run.pid, 3)
    wait_until(lambda: screens(run.pid), message="no screen")
    run.hang_up()  # the terminal goes away: SIGHUP
    wait_until(lambda: not screens(run.pid), message="the screen stayed")
    wait_steps(env, run.pid, step_of(env, run.pid) + 3)  # training goes on headless
    assert gputui("ctl", run.pid, "stop", env=env).returncode == 0
    assert run.exit_code() == 0
    import torch

    assert torch.load(out)["stopped"] == "requested"
