"""Jobs, attach, ctl and bad clients, with real processes over real sockets."""

import json
import os
import pty
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest
from helpers import socket_of

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
def env(tmp_path):
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    return {**os.environ, "XDG_RUNTIME_DIR": str(runtime), "PYTHONUNBUFFERED": "1"}


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(SCRIPT))
    return path


def gputui(env, *args, timeout=60):
    return subprocess.run(
        [sys.executable, "-m", "gputui", *map(str, args)], capture_output=True, text=True, env=env, timeout=timeout
    )


def step_of(env, pid):
    done = gputui(env, "attach", pid, "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout).get("step")


def wait_steps(env, pid, n, timeout=60):
    """Until the job has trained `n` steps: its records, read as they come from its socket."""
    with Connection(socket_of(env, pid), timeout=timeout) as conn:
        latest = conn.welcome().latest
        step = 0 if latest is None else latest.step
        while step < n:
            record = conn.read()
            assert record is not None, "the job ended first"
            if record["kind"] == "steps":
                step = record["rows"][-1][1]


@pytest.fixture
def job(env, script, tmp_path):
    metrics = tmp_path / "m.jsonl"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gputui",
            "run",
            "--headless",
            "--metrics",
            str(metrics),
            str(script),
            str(tmp_path / "out.pt"),
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        socket_of(env, proc.pid)
        wait_steps(env, proc.pid, 2)
    except BaseException:  # the job must not train on after a failed setup (it has no end of its own)
        proc.kill()
        proc.communicate(timeout=30)
        raise
    yield proc
    if proc.poll() is None:
        proc.kill()
    proc.communicate(timeout=30)


def test_jobs_attach_json_and_ctl(env, job, tmp_path):
    listed = json.loads(gputui(env, "jobs", "--json").stdout)
    assert [(j["pid"], j["script"], j["device"], j["state"]) for j in listed] == [
        (job.pid, "train.py", "cpu", "training")
    ]
    text = gputui(env, "jobs").stdout.splitlines()
    assert text[0].split()[:3] == ["PID", "SCRIPT", "DEVICE"] and str(job.pid) in text[1]

    done = gputui(env, "ctl", job.pid, "halve-batch")
    assert done.returncode == 0, done.stderr
    assert f"job {job.pid}: after step" in done.stdout and "micro-batch 16 -> 8 (accumulation 2)" in done.stdout
    assert gputui(env, "ctl", job.pid, "halve-batch").returncode == 0
    done = gputui(env, "ctl", job.pid, "checkpointing", "on")
    assert done.returncode == 1 and "not applied, no repeated blocks found" in done.stdout
    done = gputui(env, "ctl", job.pid, "amp", "fp8")
    assert done.returncode == 1 and done.stderr == "gputui: error: amp takes one of off, bf16, fp16\n"

    done = gputui(env, "ctl", job.pid, "stop")
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
    before = step_of(env, job.pid)
    time.sleep(1.0)
    after = step_of(env, job.pid)
    assert after > before + 5, "the job must keep training"
    done = gputui(env, "ctl", job.pid, "pause")
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
    assert gputui(env, "ctl", job.pid, "resume").returncode == 0
    assert gputui(env, "ctl", job.pid, "stop").returncode == 0
    _, err = job.communicate(timeout=30)
    assert "telemetry server error" not in err and "Traceback" not in err, err


def test_sigkill_leaves_a_stale_socket_that_jobs_cleans(env, job):
    path = socket_of(env, job.pid)
    job.kill()
    job.wait(timeout=30)
    assert os.path.exists(path)  # SIGKILL gave it no chance to clean up
    assert gputui(env, "jobs").stdout.startswith("no running gputui jobs")
    assert not os.path.exists(path)
    done = gputui(env, "attach", job.pid, "--json")
    assert done.returncode == 1 and "is not running" in done.stderr


def test_plain_python_scripts_are_attachable_too(env, script, tmp_path):
    proc = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path / "out.pt")],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        socket_of(env, proc.pid)
        wait_steps(env, proc.pid, 1)
        assert gputui(env, "ctl", proc.pid, "stop").returncode == 0
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


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
def test_ctl_says_the_job_ended_before_applying_it(env, tmp_path, mode, said):
    path, ready = tmp_path / "ends.py", tmp_path / "ready"
    path.write_text(ENDS)
    proc = subprocess.Popen(
        [sys.executable, "-m", "gputui", "run", "--headless", str(path), mode, str(ready)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():  # the socket is served before the script starts
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.05)
        done = gputui(env, "ctl", proc.pid, "halve-batch")
        before, _, after = said.format(pid=proc.pid, idle="{idle}").partition("{idle}")  # seconds vary
        assert done.returncode == 1, done.stderr
        assert done.stdout.startswith(before) and done.stdout.endswith(after + "\n"), done.stdout
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_attach_needs_a_job(env):
    done = gputui(env, "attach")
    assert done.returncode == 1 and done.stderr.startswith("gputui: error: no running gputui jobs of yours")
    done = gputui(env, "ctl", "999999", "pause")
    assert done.returncode == 1 and "process 999999 is not running" in done.stderr


def test_the_tui_survives_its_terminal_closing(env, script, tmp_path):
    out = tmp_path / "out.pt"
    pid, master = pty.fork()
    if pid == 0:  # the child: gputui run in a pseudo-terminal, as over SSH
        os.execve(
            sys.executable,
            [sys.executable, "-m", "gputui", "run", str(script), str(out)],
            {**env, "TERM": "xterm-256color"},
        )
    try:
        socket_of(env, pid)
        wait_steps(env, pid, 3)
        os.close(master)  # the terminal goes away: SIGHUP
        time.sleep(1.0)
        first = step_of(env, pid)
        time.sleep(1.0)
        assert step_of(env, pid) > first, "training goes on headless"
        assert gputui(env, "ctl", pid, "stop").returncode == 0
        deadline = time.monotonic() + 30
        while (status := os.waitpid(pid, os.WNOHANG))[0] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert os.waitstatus_to_exitcode(status[1]) == 0
        import torch

        assert torch.load(out)["stopped"] == "requested"
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
