"""Run every benchmark and write RESULTS.md (the tables) and results.json (the raw figures).

    python benchmarks/run.py            # all of them, a few minutes on a 2-core CPU
    python benchmarks/run.py --quick    # a short version while developing (written to a temp dir)
    python benchmarks/run.py --only overhead,latency --device cuda

Each benchmark runs in its own process, so one that fails is reported and the rest still run.
Only the project's own dependencies are needed.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from typing import Any

import gpu_check
import harness

BENCHMARKS = {
    "overhead": "Overhead: plain loop, gputui.fit headless, gputui run headless and with its TUI",
    "latency": "Control latency",
    "recovery": "OOM recovery",
    "remedies": "Memory saved per remedy",
    "planner": "What-if planner: prediction time, accuracy, and what a plan costs the training",
    "tool_costs": "Costs of the tool itself",
    "distributed": "Under torchrun: gputui.fit against a plain DDP loop, and the per-step exchange",
    "models": "Other models: fit's cost beside steps shaped unlike the demos",
}
TIMEOUT = 1800


def machine(device: str) -> dict[str, Any]:
    import psutil
    import torch

    import gputui

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "ram": psutil.virtual_memory().total,
        "os": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "gputui": gputui.__version__,
        "commit": gpu_check.commit(),
        "device": device,
        "gpu": torch.cuda.get_device_name(device) if device.startswith("cuda") else None,
    }


def run_one(name: str, quick: bool, device: str, tmp: str) -> dict[str, Any]:
    out = os.path.join(tmp, f"{name}.json")
    argv = [sys.executable, os.path.join(harness.HERE, f"{name}.py"), "--json", out, "--device", device]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(argv + (["--quick"] if quick else []), stderr=subprocess.PIPE, text=True, timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {TIMEOUT}s", "elapsed_s": time.monotonic() - t0}
    if proc.returncode or not os.path.exists(out):
        return {
            "error": f"exit code {proc.returncode}: {proc.stderr.strip()[-3000:]}",
            "elapsed_s": time.monotonic() - t0,
        }
    with open(out) as f:
        return {"result": json.load(f), "elapsed_s": time.monotonic() - t0}


def bimodal(workload: dict[str, Any]) -> bool:
    """The plain loop's own runs spread over 25 %: the machine, not a loop, sets the speed of a run."""
    plain = workload["samples_per_s"]["plain"]
    return bool(plain.get("min")) and plain["max"] / plain["min"] > 1.25


def headline(results: dict[str, Any], m: dict[str, Any]) -> str:
    """The sentence the README quotes, built from the figures."""
    from gputui.units import format_bytes

    oh = results.get("overhead", {}).get("result")
    made = {**m, **results.get("overhead", {}).get("made", {})}  # the machine the overhead figures were made on
    where = f"On a {made['cores']}-core {made['cpu']}" + (f" with {m['gpu']}" if m["gpu"] else " with no GPU")
    parts = []
    if oh and {"mlp", "gpt"} <= set(oh["workloads"]):
        gpt = oh["workloads"]["gpt"]
        free = oh["workloads"].get("mlp-1t")
        mlp = free or oh["workloads"]["mlp"]

        def at(w: dict[str, Any]) -> str:
            """The loops' paired ratios: each run against the plain run beside it (a slow spell of this VM
            falls on both; the ratio of medians, in RESULTS.md too, does not cancel it)."""
            pr = {loop: w["paired_ratio"][loop]["median"] for loop in ("fit", "run", "tui")}
            return f"{pr['fit']:.2f}x, {pr['run']:.2f}x and {pr['tui']:.2f}x"

        def step(w: dict[str, Any]) -> str:
            ms = w["step_ms"]["plain"].get("median")
            return f"a {ms:.{0 if ms >= 10 else 1}f} ms step" if ms else "its step"

        threads = ", torch on one thread" if free else ""
        parts.append(
            f"against a plain PyTorch loop run beside it (each run in turn, median of {oh['repetitions']} turns), "
            f"`gputui.fit` trained the small GPT of demos/gpt.py ({step(gpt)}) at {at(gpt)} of its samples per "
            f"second (headless, under `gputui run --headless`, under the TUI), the tiny MLP of demos/mlp.py "
            f"({step(mlp)}{threads}) at {at(mlp)}"
        )
        sizes = importlib.import_module("overhead").WORKLOADS
        larger = [
            (name, oh["workloads"][name]) for name in ("mlp-b512", "mlp-b832", "mlp-b1024") if name in oh["workloads"]
        ]
        for i, (name, w) in enumerate(larger):
            joint = " and" if i == len(larger) - 1 else ","
            blocks = w["alternating"]["ratio"] if "alternating" in w else None
            in_blocks = f" ({blocks:.3f} in whole fit() blocks in one process)" if blocks else ""
            parts[-1] += f"{joint} the same MLP at batch {sizes[name][2]} ({step(w)}) at {at(w)}{in_blocks}"
        parts[-1] += (
            f"; measured step by step in one process, fit adds {mlp['interleaved']['added_us']['median']:.0f} us "
            "to the tiny MLP's step"
        )
        two = oh["workloads"]["mlp"]
        if free and not bimodal(two):
            parts[-1] += f" (on torch's two threads: {at(two)})"
        own = oh.get("own")
        if own:
            ms = own["interleaved"]["plain_ms"]["median"]
            parts.append(
                f"on a {ms:.2f} ms step that is mostly torch's own Python, where nothing else moves the figure, "
                f"fit adds {own['blocks']['added_us']['median']:.0f} us a step (whole fit() calls taking turns with "
                f"a plain loop; {own['interleaved']['added_us']['median']:.0f} us step by step)"
            )
    lat = results.get("latency", {}).get("result")
    if lat:
        worst = max(w["steps"]["max"] for w in lat["workloads"].values())
        parts.append(
            "every control was applied at the next step boundary"
            if worst <= 1
            else f"every control was applied within {worst:.0f} steps"
        )
    rec = results.get("recovery", {}).get("result")
    if rec and rec["budget"]["oom_to_next_step_ms"].get("n"):
        b, manual = rec["budget"], rec["manual"]
        parts.append(
            f"an OOM was recovered to the next completed step in {b['oom_to_next_step_ms']['median']:.0f} ms, "
            f"and {manual['ooms']} OOMs in a row moved RSS by {format_bytes(manual['rss_growth_after_settle'])}"
        )
    if not parts:
        return "No headline: the benchmarks that make it did not run."
    return f"{where}, " + "; ".join(parts) + "."


def markdown(results: dict[str, Any], m: dict[str, Any], quick: bool, head: str) -> str:
    from gputui.units import format_bytes

    lines = ["# gputui benchmarks", ""]
    if quick:
        lines += ["**A quick run (`--quick`): fewer and shorter runs, not for quoting.**", ""]
    lines += [
        "Made by `python benchmarks/run.py`; the raw figures are in results.json beside this file.",
        "",
        f"- machine: {m['cpu']}, {m['cores']} cores, {format_bytes(m['ram'])} RAM; {m['os']}",
        f"- Python {m['python']}, torch {m['torch']} ({m['torch_threads']} threads), gputui {m['gputui']} "
        f"(commit {m['commit']})",
        f"- device: {m['device']}"
        + (f" ({m['gpu']})" if m["gpu"] else f' (no GPU here: every GPU figure says "{harness.NOT_MEASURED}")'),
        f"- date: {m['date']}",
        "",
        "**Headline.** " + head,
        "",
    ]
    for name, title in BENCHMARKS.items():
        if name not in results:
            continue
        r = results[name]
        lines += [f"## {title}", ""]
        module = importlib.import_module(name)
        lines.append((module.__doc__ or "").strip().split("\n\n")[0].replace("\n", " "))
        lines.append("")
        if "error" in r:
            lines += ["**Failed:**", "", "```", r["error"], "```", ""]
        else:
            lines += [module.markdown(r["result"]), f"_({r['elapsed_s']:.0f} s{provenance(r.get('made', {}), m)})_", ""]
    return "\n".join(lines)


def provenance(made: dict[str, Any], m: dict[str, Any]) -> str:
    """Nothing for a section this run made (on machine `m`); for one kept from another run, its commit,
    date and machine."""
    if made.get("commit") == m["commit"] and made.get("cpu", m["cpu"]) == m["cpu"]:
        return ""
    note = f"; kept from commit {made.get('commit')}, {made.get('date')}"
    if "cpu" not in made:
        return note + ", machine not recorded"
    return note + (f", made on a {made['cores']}-core {made['cpu']}" if made["cpu"] != m["cpu"] else "")


def write(out: str, results: dict[str, Any], m: dict[str, Any], quick: bool) -> str:
    """results.json and RESULTS.md of the benchmarks run so far (RESULTS.md keeps its GPU check section,
    which benchmarks/gpu_check.py writes); returns the headline."""
    head = headline(results, m)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump({"machine": m, "quick": quick, "headline": head, "results": results}, f, indent=1)
    path = os.path.join(out, "RESULTS.md")
    text = markdown(results, m, quick, head) + "\n" + gpu_check.kept_section(path)
    with open(path, "w") as f:
        f.write(text)
    return head


def kept(out: str, running: list[str]) -> dict[str, Any]:
    """The results in `out` of the benchmarks not run now (`--only`), each with the commit, date and machine
    it was made at: a rerun of some replaces theirs and keeps the rest, said as kept (and where)."""
    try:
        with open(os.path.join(out, "results.json")) as f:
            previous = json.load(f)
    except (OSError, ValueError):
        return {}
    made = {k: previous.get("machine", {}).get(k) for k in ("commit", "date", "cpu", "cores")}
    out = {}
    for name, r in previous.get("results", {}).items():
        if name in running:
            continue
        own = r.get("made", made)
        if "cpu" not in own and own.get("commit") == made["commit"]:  # made by that run, on its machine
            own = made
        out[name] = {**r, "made": own}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="short runs, written to a temp dir unless --out is given")
    p.add_argument("--only", help=f"comma-separated, of: {', '.join(BENCHMARKS)}")
    p.add_argument("--device", default="auto", help="cpu, cuda or auto (default: cuda where there is one)")
    p.add_argument("--out", help="folder for RESULTS.md and results.json (default: benchmarks/)")
    args = p.parse_args()
    names = args.only.split(",") if args.only else list(BENCHMARKS)
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        p.error(f"unknown benchmark(s): {', '.join(unknown)}")
    device = harness.device_of(args.device)
    out = args.out or (tempfile.mkdtemp(prefix="gputui-bench-quick-") if args.quick else harness.HERE)
    os.makedirs(out, exist_ok=True)
    m = machine(device)
    results = kept(out, names) if args.only and not args.quick else {}
    with tempfile.TemporaryDirectory(prefix="gputui-bench-") as tmp:
        for name in names:
            print(f"== {name}", file=sys.stderr, flush=True)
            results[name] = {
                **run_one(name, args.quick, device, tmp),
                "made": {k: m[k] for k in ("commit", "date", "cpu", "cores")},
            }
            if "error" in results[name]:
                print(f"   failed: {results[name]['error'][-500:]}", file=sys.stderr)
            head = write(out, results, m, args.quick)  # after each: a run cut short keeps what it got
    print(f"{head}\nwrote {os.path.join(out, 'RESULTS.md')} and results.json", file=sys.stderr)
    return 1 if any("error" in r for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
