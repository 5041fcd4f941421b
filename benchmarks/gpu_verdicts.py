"""What each stage of benchmarks/gpu_check.py proved, read from the files it wrote: (passed, figures,
one line for the summary). A stage cut short is read too: its figures are what it got. No torch here."""

from __future__ import annotations

import glob
import json
import os
import pickle
import re
import xml.etree.ElementTree as ET
from typing import Any

from gputui.units import format_bytes, parse_size

Verdict = tuple[bool, dict[str, Any], str]

FILES = (
    "summary.md",
    "summary.json",
    "gpu_check.log",
    "junit.xml",
    "metrics.jsonl",
    "bench/RESULTS.md",
    "bench/results.json",
)
"""What the output folder holds: the device tool brings back 8 files at most."""
CAP = "4GiB"  # the demo GPT's whole batch peaks near 10 GiB (the planner's trace), 8 samples near 3.6
CLI_STEPS = 10


def _json(path: str) -> dict[str, Any]:
    with open(path) as f:
        return json.load(f)


def _records(path: str) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _us(s: dict[str, Any] | None) -> str:
    return f"{s['median']:.1f} us" if s and s.get("n") else "n/a"


def device_line(env: dict[str, Any]) -> str:
    d = env["device"]
    return f"{d['name']} ({format_bytes(d['total'])}), torch {env['torch']} (CUDA {env['cuda']})"


def env(out: str, tmp: str, output: str) -> Verdict:
    e = _json(f"{tmp}/env.json")
    nvml = e["nvml"]
    mig = nvml.get("mig")
    mig_text = ("on" if mig["current"] else "off") if isinstance(mig, dict) else (mig or "n/a")
    conf = ", ".join(f"{k}={v}" for k, v in e["alloc_conf"].items() if v) or "no alloc conf set"
    missing = e["torch_names"]["missing"]
    line = (
        f"{device_line(e)}, cuDNN {e['cudnn']}, NCCL {e['nccl']}; driver {nvml.get('driver', nvml.get('error'))}; "
        f"MIG {mig_text}; allocator {e['allocator_backend']} ({conf}); NVML sees this process: "
        f"{nvml.get('sees_this_process')}; textual {e['packages'].get('textual') or 'absent'}; "
        f"{e['torch_names']['checked']} torch names gputui uses, "
        + (f"missing: {', '.join(missing)}" if missing else "all present")
    )
    return not missing, e, line


def costs(out: str, tmp: str, output: str) -> Verdict:
    c = _json(f"{tmp}/costs.json")
    a, n = c["allocator"], c["nvml"]
    parts = [
        f"memory_stats {_us(a['memory_stats'])} ({a['memory_stats_keys']} keys; nested dict {_us(a['memory_stats_as_nested_dict'])})",
        f"probe read {_us(a['probe_read'])}",
        f"memory_allocated {_us(a['memory_allocated'])}",
        f"mem_get_info {_us(a['mem_get_info'])}",
        f"deferred loss put {_us(a['deferred_loss_put'])}",
        f"NVML read_gpus {_us(n.get('read_gpus'))}" if "error" not in n else f"NVML: {n['error']}",
    ]
    for h in c["history"]:
        if "error" in h:
            parts.append(f"history ({h['stacks']} stacks): {h['error']}")
        else:
            al = h["alloc_free_us"]
            parts.append(
                f"history ({h['stacks']} stacks): alloc+free {_us(al['off'])} -> {_us(al['on'])}, dump "
                f"{h['dump_s']:.2f} s for {h['entries']:,} entries ({format_bytes(h['pickle_bytes'])})"
            )
    return True, c, "; ".join(parts)


def tests(out: str, tmp: str, output: str) -> Verdict:
    """From the junit file; from pytest's -v lines when it never got written (the stage timed out)."""
    try:
        suite = ET.parse(f"{out}/junit.xml").getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        assert suite is not None
        counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
        bad = [
            f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
            for case in suite.iter("testcase")
            if case.find("failure") is not None or case.find("error") is not None
        ]
    except (OSError, ET.ParseError, AssertionError):
        results = re.findall(r"^(tests/\S+) (PASSED|FAILED|ERROR|SKIPPED)", output, re.M)
        counts = {
            "tests": len(results),
            "failures": sum(r == "FAILED" for _, r in results),
            "errors": sum(r == "ERROR" for _, r in results),
            "skipped": sum(r == "SKIPPED" for _, r in results),
        }
        bad = [name.split("/")[-1] for name, r in results if r in ("FAILED", "ERROR")]
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    figures = {**counts, "passed": passed, "failed": bad}
    line = (
        f"{passed} passed, {counts['failures']} failed, {counts['errors']} errors, {counts['skipped']} skipped "
        f"of {counts['tests']}" + (f"; failed: {', '.join(bad)}" if bad else "")
    )
    return passed > 0 and not bad, figures, line


def _run(records: list[dict[str, Any]]) -> dict[str, Any]:
    """A metrics file's run: its steps, OOMs, micro-batches, capacity, peak reserved, last rate."""
    steps = [r for r in records if r["kind"] == "step"]
    events = [r for r in records if r["kind"] == "event"]
    end = next((r for r in records if r["kind"] == "end"), {})
    return {
        "steps": len(steps),
        "ended": end.get("steps"),
        "error": end.get("error"),
        "ooms_recovered": end.get("ooms_recovered"),
        "micro_batches": sorted({s["micro_batch"] for s in steps}),
        "capacity": sorted({s["memory"]["capacity"] for s in steps if s["memory"].get("capacity")}),
        "peak": max((s["memory"]["peak"] or 0 for s in steps), default=None),
        "reserved": max((s["memory"]["reserved"] or 0 for s in steps), default=None),
        "samples_per_s": steps[-1].get("samples_per_s") if steps else None,
        "events": [e["name"] for e in events],
        "_events": events,
    }


def _run_line(r: dict[str, Any]) -> str:
    rate = f", {r['samples_per_s']:.0f} samples/s" if r["samples_per_s"] else ""
    return (
        f"{r['steps']} steps, {r['ooms_recovered']} OOM(s) recovered (micro-batches {r['micro_batches']}), capacity "
        f"{', '.join(format_bytes(c) for c in r['capacity']) or 'n/a'}, step peak {format_bytes(r['peak'] or 0)}, "
        f"reserved at most {format_bytes(r['reserved'] or 0)}{rate}" + (f"; error: {r['error']}" if r["error"] else "")
    )


def cli(out: str, tmp: str, output: str) -> Verdict:
    r = _run(_records(f"{out}/metrics.jsonl"))
    r.pop("_events")
    cap = parse_size(CAP)
    # The whole batch needs about 10 GiB: under the cap it must run out, and train on at a smaller micro-batch.
    bit = bool(r["ooms_recovered"])
    passed = bit and r["ended"] == CLI_STEPS and r["capacity"] == [cap] and (r["reserved"] or 0) <= cap
    line = _run_line(r) + ("" if bit else "; no OOM: the cap did not bite")
    return passed, r, line


def history(out: str, tmp: str, output: str) -> Verdict:
    r = _run(_records(f"{tmp}/history.jsonl"))
    saved = [e for e in r.pop("_events") if e["name"] == "snapshot_saved"]
    snapshots = []
    for e in saved:
        with open(e["path"], "rb") as f:
            snap = pickle.load(f)
        snapshots.append(
            {
                "reason": e["reason"],
                "bytes": os.path.getsize(e["path"]),
                "segments": len(snap.get("segments", [])),
                "entries": sum(len(t) for t in snap.get("device_traces", [])),
                "summary_bytes": os.path.getsize(e["summary_path"]),
            }
        )
    r["snapshots"] = snapshots
    r["files"] = len(glob.glob(f"{tmp}/snapshots/*.pickle"))
    at_oom = [s for s in snapshots if s["reason"] == "oom"]
    shots = "; ".join(
        f"{s['reason']}: {format_bytes(s['bytes'])}, {s['segments']} segments, {s['entries']:,} history entries"
        for s in snapshots
    )
    line = f"{_run_line(r)}; snapshots: {shots or 'none'}"
    return bool(at_oom) and all(s["entries"] for s in at_oom), r, line


def nccl(out: str, tmp: str, output: str) -> Verdict:
    r = _json(f"{tmp}/rank.json")
    passed = r["backend"] == "nccl" and r["steps"] > 0 and r["ooms_recovered"] >= 1 and r["max_weight_diff"] <= 1e-5
    line = (
        f"{r['backend']}, world size {r['world_size']}: {r['steps']} steps, {r['ooms_recovered']} OOM(s) recovered "
        f"under {format_bytes(r['limit'])} (the whole batch's step {format_bytes(r['whole_step_bytes'])}), "
        f"micro-batches {r['micro_batches']} of {r['batch']}; weights against a plain loop: max diff "
        f"{r['max_weight_diff']:.3g}"
    )
    return passed, r, line


def fitcost(out: str, tmp: str, output: str) -> Verdict:
    """fit's added time a step (interleaved with a plain loop), as is and without each of its parts."""
    c = _json(f"{tmp}/fitcost.json")
    lines = []
    for name, w in c["workloads"].items():
        added = {v: s["median"] for v, s in w["added_us"].items()}
        parts = ", ".join(f"{v} +{a:.0f}" for v, a in added.items() if v != "fit")
        lines.append(
            f"{name} (plain {w['plain_ms']:.2f} ms): fit +{added['fit']:.0f} us ({w['ratio']['fit']:.3f}); {parts}"
        )
    return True, c, "; ".join(lines)


def bench(out: str, tmp: str, output: str) -> Verdict:
    results = _json(f"{out}/bench/results.json")["results"]
    parts, figures = [], {}
    for name, r in results.items():
        if "error" in r:
            parts.append(f"{name} failed: {r['error'].splitlines()[-1][:200] if r['error'] else ''}")
            continue
        res = r["result"]
        if name == "remedies" and res["rows"][0]["cuda"]:
            rows = {row["config"]: row["cuda"]["peak"] for row in res["rows"]}
            figures[name] = rows
            first, last = res["rows"][0], res["rows"][-1]
            parts.append(
                f"remedies: CUDA peak {format_bytes(first['cuda']['peak'])} at the start, "
                f"{format_bytes(last['cuda']['peak'])} all combined"
            )
        if name == "planner" and res.get("cuda"):
            worst: dict[str, float] = {}
            for model in res["cuda"]:
                for row in model["rows"]:
                    step = row["allocated"] - row.get("outside", 0)
                    error = 100 * (row["peak"] - step) / step
                    label = model["model"].split(" (")[0]
                    worst[label] = max(worst.get(label, 0.0), error, key=abs)
            figures[name] = {"worst_error_pct": worst}
            parts.append(
                "planner: CUDA predicted peak against max_memory_allocated less what was held outside the trace "
                "(the cuBLAS workspaces), worst per model: " + ", ".join(f"{k} {v:+.1f}%" for k, v in worst.items())
                if worst
                else "planner: no CUDA case measured"
            )
    ran = ", ".join(results) or "none"
    return all("error" not in r for r in results.values()), figures, f"ran {ran}: " + "; ".join(parts)


def markdown(summary: dict[str, Any], heading: bool = True) -> str:
    lines = ["# GPU check", ""] if heading else []
    done = sum(s.get("seconds", 0) for s in summary["stages"])
    lines.append(
        f"- device: {summary.get('device', 'unknown (the env stage did not finish)')}; {summary['date']}; "
        f"commit {summary.get('commit') or 'unknown'}; {done:.0f} s of stages, budget {summary['budget_s']:.0f} s"
    )
    for s in summary["stages"]:
        took = f" ({s['seconds']:.0f} s of {s['timeout']} s)" if "seconds" in s else ""
        lines.append(f"- **{s['name']}**: {s['status']}{took}: {s['line']}")
    return "\n".join(lines) + "\n"
