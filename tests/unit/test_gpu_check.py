"""benchmarks/gpu_check.py, the one command a session lent a GPU runs, as far as a machine without one
can check it: one line and exit code 2 without CUDA, its stages listed, a stage over its time stopped
with its children while the summary keeps what each stage got, and RESULTS.md's GPU check section
kept when run.py rewrites the file."""

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest
from process import python

pytestmark = pytest.mark.process  # it runs benchmarks/gpu_check.py as a process of its own

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"


@pytest.fixture
def gpu_check(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import gpu_check

    return gpu_check


def command(*args: str, **env: str) -> subprocess.CompletedProcess:
    return python(BENCHMARKS / "gpu_check.py", *args, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), **env})


def test_without_cuda_it_says_so_in_one_line_and_exits_2(tmp_path):
    done = command("--out", str(tmp_path / "gpu"), CUDA_VISIBLE_DEVICES="")
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert done.returncode == 2, lines
    assert len(lines) == 1 and re.fullmatch(r"gpu_check: no CUDA device here \(torch \S+, cuda unavailable\)", lines[0])
    assert not (tmp_path / "gpu").exists()


def test_list_prints_each_stage_with_its_timeout_and_runs_nothing(gpu_check):
    done = command("--list", CUDA_VISIBLE_DEVICES="")
    assert done.returncode == 0, done.stderr
    rows = [line.split(None, 3) for line in done.stdout.splitlines()]
    assert [(r[0], int(r[1])) for r in rows] == [
        *((s.name, s.timeout) for s in gpu_check.STAGES),
        ("budget", gpu_check.BUDGET_S),
    ]
    # What the device tool brings back from $OUT: 8 files at most, none more than 2 folders down.
    assert len(gpu_check.FILES) <= 8 and all(f.count("/") <= 1 for f in gpu_check.FILES)


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_stage_over_its_time_is_stopped_with_its_children_and_the_summary_keeps_each_stage(
    gpu_check, tmp_path, monkeypatch
):
    monkeypatch.setattr(gpu_check, "LEAST_S", 1)
    monkeypatch.setattr(gpu_check, "GRACE_S", 5)

    def said(out, tmp, output):
        return True, {"said": output.split()}, f"said {' '.join(output.split())}"

    stages = [
        gpu_check.Stage("quick", "says hello", 30, lambda out, tmp: ["echo", "hello"], said),
        # a child in the background, its pid said: it must go with the stage
        gpu_check.Stage("slow", "sleeps", 30, lambda out, tmp: ["sh", "-c", "sleep 60 & echo $!; wait"], said),
        gpu_check.Stage("late", "never starts", 30, lambda out, tmp: ["echo", "late"], said),
    ]
    out = tmp_path / "gpu"
    code = gpu_check.check(str(out), stages, budget=3.5)
    summary = json.loads((out / "summary.json").read_text())
    assert code == 1
    assert [(s["name"], s["status"]) for s in summary["stages"]] == [
        ("quick", "ok"),
        ("slow", "timed out"),  # at 2.5 s: the last stage keeps LEAST_S of the budget
        ("late", "skipped"),
    ]
    child = int(summary["stages"][1]["figures"]["said"][0])
    deadline = time.monotonic() + 5
    while not gone(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone(child)
    log = (out / "gpu_check.log").read_text()
    assert "hello\n" in log and f"{child}\n" in log and "===== late" not in log  # written as they went
    md = (out / "summary.md").read_text()
    assert "**quick**: ok" in md and "**slow**: timed out" in md and "**late**: skipped" in md


def test_run_py_keeps_the_gpu_check_section_and_record_fills_it(gpu_check, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import run

    results = tmp_path / "RESULTS.md"
    results.write_text("# old\n\n## Overhead\n\nold figures\n\n" + gpu_check.section(None) + "\n## After\n\nkept\n")
    machine = {
        k: "x" for k in ("date", "cpu", "os", "python", "torch", "torch_threads", "gputui", "commit", "device")
    } | {"cores": 2, "ram": 2**30, "gpu": None}
    run.write(str(tmp_path), {}, machine, quick=False)
    text = results.read_text()
    assert "old figures" not in text and text.count(gpu_check.SECTION) == 1 and "**Not run yet**" in text

    summary = {
        "date": "2026-12-01 10:00 UTC",
        "commit": "abc1234",
        "budget_s": 470,
        "device": "NVIDIA H100 80GB HBM3 (79.2 GiB), torch 2.11.0+cu130 (CUDA 13.0)",
        "stages": [{"name": "env", "status": "ok", "seconds": 9.0, "timeout": 60, "line": "all present"}],
    }
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    results.write_text(text + "\n## After\n\nkept\n")
    gpu_check.record(str(tmp_path / "summary.json"), str(results))
    text = results.read_text()
    assert "**Not run yet**" not in text and "- **env**: ok (9 s of 60 s): all present" in text
    assert "NVIDIA H100 80GB HBM3" in text and text.endswith("\n## After\n\nkept\n")


def test_the_planner_verdict_takes_the_error_against_the_step_less_what_was_held_outside_the_trace(gpu_check, tmp_path):
    """On an H200 each step's max_memory_allocated held 65 MiB the trace cannot see (two cuBLAS workspaces):
    against the raw peak a 12 MiB step read -84 %; against the step less that, +0.5 %."""
    from gpu_verdicts import bench

    MiB = 1 << 20
    row = {"peak": 12 * MiB, "allocated": 77 * MiB, "outside": 65 * MiB}
    results = {
        "results": {"planner": {"result": {"cuda": [{"model": "demos/mlp.py small (width 128)", "rows": [row]}]}}}
    }
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "results.json").write_text(json.dumps(results))
    passed, figures, line = bench(str(tmp_path), str(tmp_path), "")
    assert passed and figures["planner"] == {"worst_error_pct": {"demos/mlp.py small": 0.0}}
    assert "worst per model: demos/mlp.py small +0.0%" in line, line


def test_a_rerun_of_some_benchmarks_keeps_the_others_and_says_from_which_commit(monkeypatch, tmp_path):
    """`run.py --only overhead` replaced RESULTS.md with the overhead section alone: the other sections'
    figures are kept, each saying the commit, date and machine it was made at (a section kept through
    an earlier run, from before machines were recorded, says it was not)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import run

    previous = {
        "machine": {"commit": "abc1234", "date": "2026-11-27 14:34 UTC", "cpu": "AMD EPYC", "cores": 2},
        "results": {
            "overhead": {"result": {}, "elapsed_s": 1.0},
            "latency": {"result": {"x": 1}, "elapsed_s": 6.0},
            "recovery": {"result": {}, "elapsed_s": 2.0, "made": {"commit": "0ld0000", "date": "2026-11-20 10:00 UTC"}},
        },
    }
    (tmp_path / "results.json").write_text(json.dumps(previous))
    kept = run.kept(str(tmp_path), ["overhead"])
    assert kept == {
        "latency": {"made": previous["machine"], "result": {"x": 1}, "elapsed_s": 6.0},
        "recovery": previous["results"]["recovery"],
    }
    here = {"commit": "def5678", "cpu": "Intel Xeon", "cores": 2}
    said = {name: run.provenance(r["made"], here) for name, r in kept.items()}
    assert said == {
        "latency": "; kept from commit abc1234, 2026-11-27 14:34 UTC, made on a 2-core AMD EPYC",
        "recovery": "; kept from commit 0ld0000, 2026-11-20 10:00 UTC, machine not recorded",
    }
    assert run.provenance(here, here) == ""  # made by this run
    assert run.kept(str(tmp_path / "none"), ["overhead"]) == {}  # a first run keeps nothing
