import io
import json
import os

import pytest
import torch
from helpers import ConvNet, conv_batches, conv_step, halving_only
from process import python, wait_until

import gputui
from gputui.telemetry.describe import describe
from gputui.telemetry.jsonl import MetricsFile
from gputui.telemetry.progress import ProgressLine, closing_lines, summary_line
from gputui.telemetry.run import RunInfo, RunSummary
from gputui.units import format_bytes

STEP_KEYS = {
    "v",
    "kind",
    "t",
    "step",
    "epoch",
    "loss",
    "batch_size",
    "micro_batch",
    "accumulation",
    "amp",
    "checkpointing",
    "device",
    "allocated",
    "reserved",
    "fragmented",
    "peak",
    "rss",
    "samples_per_s",
}


def test_metrics_file_schema(tmp_path, monkeypatch):
    halving_only(monkeypatch)  # the planner's pick depends on how much tracing a loaded machine gets done
    path = tmp_path / "m.jsonl"
    model = ConvNet()
    gputui.fit(
        model,
        conv_batches(4, 8),
        conv_step,
        torch.optim.SGD(model.parameters(), lr=0.1),
        micro_batch=4,
        memory_budget="50KiB",
        metrics=path,
    )
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines[0]["kind"] == "start" and lines[-1]["kind"] == "end"
    steps = [x for x in lines if x["kind"] == "step"]
    assert [x["step"] for x in steps] == [1, 2, 3, 4]
    for x in steps:
        assert STEP_KEYS <= set(x)
        assert x["v"] == 1 and x["device"] == "cpu" and x["amp"] == "off" and x["checkpointing"] is False
        assert (
            x["batch_size"] == 8
            and x["micro_batch"] * (x["accumulation"] - 1) < 8 <= x["micro_batch"] * x["accumulation"]
        )
        assert isinstance(x["loss"], float) and x["allocated"] > 0 and x["peak"] >= x["allocated"]
        assert x["reserved"] is None and x["fragmented"] is None and x["rss"] > 0
    assert steps[0]["samples_per_s"] is None and steps[-1]["samples_per_s"] > 0
    events = [x for x in lines if x["kind"] == "event"]
    assert events and all({"v", "t", "step", "name"} <= set(e) for e in events)
    assert events[0]["name"] == "oom_recovered" and (events[0]["micro_batch"], events[0]["micro_batch_to"]) == (4, 2)
    assert lines[-1]["steps"] == 4 and lines[-1]["error"] is None


def test_a_metrics_file_given_again_keeps_the_run_before_it(tmp_path):
    """A resumed run (or a rerun) pointed at the same file adds its own lines after the first run's: its
    history is not lost."""
    path = tmp_path / "m.jsonl"
    for steps in (3, 2):
        model = ConvNet()
        gputui.fit(model, conv_batches(steps, 4), conv_step, torch.optim.SGD(model.parameters(), lr=0.1), metrics=path)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    kinds = [x["kind"] for x in lines if x["kind"] != "event"]
    assert kinds == ["start", "step", "step", "step", "end", "start", "step", "step", "end"]
    assert [x["step"] for x in lines if x["kind"] == "step"] == [1, 2, 3, 4, 5]  # one process: one run, counted on


def test_nan_loss_is_null_in_json_and_reported_once(tmp_path):
    path = tmp_path / "m.jsonl"
    model = ConvNet()

    def step(model, batch):
        return conv_step(model, batch) * float("nan")

    result = gputui.fit(model, conv_batches(3, 2), step, torch.optim.SGD(model.parameters(), lr=0.1), metrics=path)
    lines = [json.loads(line) for line in path.read_text().splitlines()]  # strict JSON: no NaN tokens
    assert all(x["loss"] is None for x in lines if x["kind"] in ("step", "end"))
    assert [e.name for e in result.events] == ["loss_not_finite"]
    assert "last loss nan;" in summary_line(result.summary())  # as the progress lines said it, not "n/a"


def run_with_progress(stream, hub):
    hub.add_sink(ProgressLine(stream))
    model = ConvNet()
    hub.controls.request("halve_batch")
    gputui.fit(model, conv_batches(3, 4), conv_step, torch.optim.SGD(model.parameters(), lr=0.1))
    hub.finish()  # the script ends: the run's summary line


def test_progress_plain_lines_when_not_a_terminal(hub):
    out = io.StringIO()
    run_with_progress(out, hub)
    text = out.getvalue()
    assert "\r" not in text and "\x1b" not in text
    lines = text.splitlines()
    assert lines[0].startswith("gputui: training ConvNet") and "on CPU" in lines[0]
    assert lines[1] == "gputui: step 0 | micro-batch 4 -> 2 (accumulation 2)"
    assert lines[2].startswith("step 1/3 | epoch 1/1 | loss ") and "batch 2x2=4" in lines[2]
    assert lines[-2].startswith("step 3/3") and lines[-1].startswith("gputui: done: 3 steps, 12 samples")


def test_a_second_fit_call_counts_on_to_the_runs_new_total(hub):
    out = io.StringIO()
    hub.add_sink(ProgressLine(out))
    model = ConvNet()
    for n in (3, 2):
        gputui.fit(model, conv_batches(n, 4), conv_step, torch.optim.SGD(model.parameters(), lr=0.1))
    hub.finish()
    lines = out.getvalue().splitlines()
    assert [x for x in lines if x.startswith("gputui: training")] == [lines[0]]
    assert [x.split(" | ")[0] for x in lines if x.startswith("step ")] == [
        "step 1/3",
        "step 3/3",
        "step 4/5",
        "step 5/5",
    ]
    assert "gputui: step 3 | training goes on (5 steps in all)" in lines
    assert lines[-1].startswith("gputui: done: 5 steps, 20 samples")


class Tty(io.StringIO):
    def isatty(self):
        return True


def test_progress_redraws_in_place_on_a_terminal(hub):
    out = Tty()
    run_with_progress(out, hub)
    text = out.getvalue()
    assert "\rstep 1/3" in text and "\x1b[K" in text
    assert text.endswith("\n") and text.splitlines()[-1].startswith("gputui: done")


class BrokenPipe(io.StringIO):
    """stdout whose reader went away after `ok` writes."""

    def __init__(self, ok: int) -> None:
        super().__init__()
        self.ok, self.tries = ok, 0

    def write(self, text):
        self.tries += 1
        if self.tries > self.ok:
            raise BrokenPipeError(32, "Broken pipe")
        return super().write(text)


def failures(hub):
    return [e for e in hub.events() if e.name == "sink_failed"]


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_metrics_file_on_a_full_disk_says_so_once_and_training_goes_on(hub, capsys):
    metrics = MetricsFile("/dev/full")
    hub.add_sink(metrics)
    model = ConvNet()
    result = gputui.fit(model, conv_batches(3, 4), conv_step, torch.optim.SGD(model.parameters(), lr=0.1))
    metrics.close()  # what `gputui run` does at exit: nothing left to flush, nothing raised
    assert result.steps == 3
    assert (
        capsys.readouterr().err
        == "gputui: metrics file /dev/full: No space left on device; no more lines will be written\n"
    )
    [event] = failures(hub)
    assert (event["sink"], event["path"], event["error"]) == ("metrics", "/dev/full", "No space left on device")
    assert describe(event) == "metrics file /dev/full: No space left on device; no more lines will be written"


def test_a_broken_stdout_stops_the_progress_line_once(hub, capsys):
    out = BrokenPipe(ok=2)
    hub.add_sink(ProgressLine(out))
    model = ConvNet()
    result = gputui.fit(model, conv_batches(3, 4), conv_step, torch.optim.SGD(model.parameters(), lr=0.1))
    assert result.steps == 3 and out.tries == 3  # the failed write was the last one tried
    assert capsys.readouterr().err == "gputui: progress line: Broken pipe; no more progress will be written\n"
    assert [e["sink"] for e in failures(hub)] == ["progress"]


def test_under_torchrun_each_rank_writes_its_own_metrics_file_and_rank_0_alone_draws_progress(tmp_path, monkeypatch):
    """torchrun's ranks share a command line (`--metrics m.jsonl`) and a terminal: one file would tear
    its lines, two progress lines would interleave."""
    from gputui.telemetry.hub import Overrides
    from gputui.telemetry.run import RunInfo
    from gputui.telemetry.setup import opened

    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank, name in (("0", "m.jsonl"), ("1", "m.rank1.jsonl")):
        monkeypatch.setenv("RANK", rank)
        out = io.StringIO()
        with opened(Overrides(metrics=str(tmp_path / "m.jsonl")), progress=out, attachable=False) as hub:
            hub.start(RunInfo(model="Net", rank=int(rank), world_size=2))
        assert json.loads((tmp_path / name).read_text().splitlines()[0])["rank"] == int(rank)
        assert ("gputui: training Net" in out.getvalue()) == (rank == "0"), out.getvalue()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.jsonl", "m.rank1.jsonl"]


def test_under_torchrun_each_rank_names_its_snapshots(tmp_path, monkeypatch):
    """Every rank may dump into the one --snapshot-dir: the file says whose it is."""
    from gputui.probes import snapshot

    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", lambda path: open(path, "wb").close())
    monkeypatch.setattr(torch.cuda, "memory_summary", lambda device: "summary")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    paths = snapshot.dump(str(tmp_path), torch.device("cuda", 1), step=3, reason="oom")
    assert os.path.basename(paths["path"]).startswith(f"snapshot-rank1-{os.getpid()}-step3-oom-")
    monkeypatch.delenv("WORLD_SIZE")
    paths = snapshot.dump(str(tmp_path), torch.device("cuda", 0), step=3, reason="oom")
    assert os.path.basename(paths["path"]).startswith(f"snapshot-{os.getpid()}-step3-oom-")


def test_a_plan_whose_rows_are_still_coming_is_printed_once_whole():
    from gputui.telemetry.sample import Event

    out = io.StringIO()
    line = ProgressLine(out)
    details = {"trigger": "oom", "capacity": 2**20, "correction": 0, "tracked": True, "options": []}
    line.on_event(Event("plan", 2, {**details, "complete": False}))
    line.on_event(Event("plan", 3, {**details, "complete": True}))
    assert out.getvalue() == "gputui: step 3 | plan: no remedy applies\n"


def test_an_oom_waiting_for_an_answer_says_where_to_give_it():
    """Auto-recover off, no screen: the run waits at the OOM, and the line says how to answer from elsewhere."""
    from gputui.telemetry.sample import Event

    details = {"phase": "backward", "message": "CUDA out of memory", "micro_batch": 8, "attempt": 1}
    details |= {"allocated_before": 0, "leaked": 0, "recovered": False, "planning": False}
    out = io.StringIO()
    line = ProgressLine(out)
    line.on_event(Event("oom", 4, {**details, "waiting": True}))
    said = out.getvalue().splitlines()
    assert said[0] == "gputui: step 4 | OOM in backward at micro-batch 8: paused, waiting for a remedy"
    pid = os.getpid()
    assert said[1] == f"gputui: answer it from another terminal: gputui attach {pid} --control, or gputui ctl {pid} ..."
    line.on_event(Event("oom", 5, details))
    assert len(out.getvalue().splitlines()) == 3  # an OOM not waiting has nothing to answer


def test_closing_lines_say_how_each_fit_run_ended_and_what_was_saved(hub, tmp_path):
    """What the TUI prints as it closes, in headless's words."""
    hub.start(RunInfo(mode="fit"))
    ended = dict(steps=5, samples=80, micro_batch=8, loss=0.5, amp="bf16", checkpointing=True, elapsed_s=2.0)
    hub.end(RunSummary(**ended, stopped="requested", ooms_recovered=1))
    hub.start(RunInfo(mode="observe"))  # an own loop prints its own: no line of ours
    hub.end(RunSummary(steps=3))
    path = tmp_path / "ck.pt"
    gputui.save({"w": torch.ones(4)}, path)
    assert closing_lines(hub) == [
        "gputui: stopped (requested): 5 steps, 80 samples in 2.0s; last loss 0.5; micro-batch 8, amp bf16, "
        "checkpointing on, 1 OOM recovered",
        f"gputui: saved {path} ({format_bytes(path.stat().st_size)})",
    ]
    one = summary_line(RunSummary(steps=1, samples=1, micro_batch=1, ooms_recovered=2, stopped="requested"))
    assert one.startswith("gputui: stopped (requested): 1 step, 1 sample in ") and one.endswith(", 2 OOMs recovered")


def test_a_metrics_file_has_each_step_while_training_goes_on_and_every_line_in_order(hub, tmp_path):
    """Steps are written by the file's own thread within its FLUSH_S of the hub handing them over (a step
    does not wait for it); an event is written after the steps before it, and close() writes what is left."""
    path = tmp_path / "m.jsonl"
    metrics = MetricsFile(path)
    hub.add_sink(metrics)
    calls = []

    def written():
        return [json.loads(line) for line in path.read_text().splitlines()]

    def step(model, batch):
        calls.append(1)
        if len(calls) == 2:
            hub.controls.request("halve_batch", source="test")  # an event at the boundary after step 2
        if len(calls) == 6:  # step 4's second piece (steps 3 and 4 run in halves): the event handed step 2 over
            wait_until(lambda: any(r.get("step") == 2 for r in written()), 5, "step 2's line while training")
        return conv_step(model, batch)

    model = ConvNet()
    gputui.fit(model, conv_batches(5, 4), step, torch.optim.SGD(model.parameters(), lr=0.1))
    metrics.close()
    order = [(r["kind"], r.get("name"), r["step"]) for r in written()[1:] if r.get("name") != "part_ended"]
    assert order == [("step", None, 1), ("step", None, 2), ("event", "micro_batch_changed", 2)] + [
        ("step", None, n) for n in (3, 4, 5)
    ]


FORKS_MID_RUN = """
import os, sys
import torch
import gputui
from gputui.telemetry.jsonl import MetricsFile
from gputui.telemetry.setup import for_process

hub = for_process(None)
hub.add_sink(MetricsFile(sys.argv[1]))  # never closed by the script
calls = []

def step(model, batch):
    calls.append(1)
    if len(calls) == 4 and os.fork() == 0:  # a child that ends normally (its atexit runs), steps queued
        sys.exit(0)
    return model(batch[0]).pow(2).mean()

model = torch.nn.Linear(4, 1)
gputui.fit(model, [(torch.randn(8, 4),)] * 5, step, torch.optim.SGD(model.parameters(), lr=0.1))
"""


@pytest.mark.process
def test_a_metrics_file_never_closed_has_every_step_once_and_a_forked_child_adds_none(tmp_path):
    """Its steps queued at a fork are the parent's to write (the child wrote them again), and at exit
    the steps still queued are written (they were lost without a close())."""
    path = tmp_path / "m.jsonl"
    done = python("-c", FORKS_MID_RUN, path, env={**os.environ, "GPUTUI_NO_SOCKET": "1"})
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in lines if r["kind"] == "step"] == [1, 2, 3, 4, 5]
    assert [r["kind"] for r in lines].count("start") == 1 and lines[-1]["kind"] == "end"
