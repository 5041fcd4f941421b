"""`gputui jobs` and attach's choice among jobs when some are ranks of a torchrun job: each rank serves
its own socket, so they are listed together, in rank order, each saying which it is; a one-process
job is listed as before. The jobs are servers in this process, each under the pid of a live process
(find_jobs lists only those), as the sockets of torchrun's workers would be."""

import io
import json
import re
import sys

import pytest
from process import wait_until

from gputui import jobs
from gputui.telemetry.hub import Hub
from gputui.telemetry.paths import socket_path
from gputui.telemetry.run import RunInfo
from gputui.telemetry.server import TelemetryServer

HEADER = "    PID  SCRIPT           DEVICE   STATE            STEP     UPTIME  SOCKET"
TORCHRUN = "run7@node0:29500"


@pytest.fixture
def three_jobs(tmp_path, monkeypatch, processes):
    """Three jobs by socket name (the order find_jobs lists them in): rank 1 of a two-rank job, a
    one-process job, then rank 0: listed as they come, the ranks would be apart and out of order."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    sleepers = [processes.start(["sleep", "60"]) for _ in range(3)]
    pids = sorted((p.pid for p in sleepers), key=str)
    infos = [
        RunInfo(argv=("ddp.py",), rank=1, world_size=2, job=TORCHRUN),
        RunInfo(argv=("single.py",)),
        RunInfo(argv=("ddp.py",), rank=0, world_size=2, job=TORCHRUN),
    ]
    servers = []
    try:
        for pid, info in zip(pids, infos, strict=True):
            hub = Hub()
            servers.append(TelemetryServer(hub, socket_path(pid)).start())
            hub.start(info)
        # each server thread took its run in
        wait_until(lambda: all(server._so_far.info for server in servers), 10, "a server never saw its run start")
        yield dict(zip(("rank1", "single", "rank0"), pids, strict=True))
    finally:
        for server in servers:
            server.close()


@pytest.mark.process
def test_the_ranks_of_a_job_are_listed_together_in_rank_order(three_jobs):
    out = io.StringIO()
    assert jobs.list_jobs(False, out) == 0
    header, *rows = out.getvalue().splitlines()
    assert header == HEADER
    assert [int(row.split()[0]) for row in rows] == [three_jobs["rank0"], three_jobs["rank1"], three_jobs["single"]]
    assert re.match(rf" *{three_jobs['rank0']}  ddp\.py rank 0/2 +cpu +training ", rows[0]), rows[0]
    assert re.match(rf" *{three_jobs['rank1']}  ddp\.py rank 1/2 +cpu +training ", rows[1]), rows[1]
    assert rows[2].startswith(f"{three_jobs['single']:>7}  single.py        cpu      training  "), rows[2]  # as before

    out = io.StringIO()
    assert jobs.list_jobs(True, out) == 0
    listed = [(j["pid"], j["script"], j["rank"], j["world_size"], j["job"]) for j in json.loads(out.getvalue())]
    assert listed == [
        (three_jobs["rank0"], "ddp.py", 0, 2, TORCHRUN),
        (three_jobs["rank1"], "ddp.py", 1, 2, TORCHRUN),
        (three_jobs["single"], "single.py", 0, 1, ""),
    ]


@pytest.mark.process
def test_attach_offers_each_rank_by_name(three_jobs, monkeypatch):
    monkeypatch.setattr(sys.stdin, "isatty", lambda: True)
    asked = []
    monkeypatch.setattr("builtins.input", lambda prompt: asked.append(prompt) or "2")
    err = io.StringIO()
    job = jobs.resolve(None, err=err, choose=True)
    assert (job.pid, job.path) == (three_jobs["rank1"], socket_path(three_jobs["rank1"]))
    offered = err.getvalue().splitlines()
    assert [line.split()[:4] for line in offered] == [
        ["[1]", str(three_jobs["rank0"]), "ddp.py", "rank"],
        ["[2]", str(three_jobs["rank1"]), "ddp.py", "rank"],
        ["[3]", str(three_jobs["single"]), "single.py", "cpu"],
    ]
    assert "ddp.py rank 0/2" in offered[0] and "ddp.py rank 1/2" in offered[1]
    assert asked == ["attach to which job? [1-3] "]
