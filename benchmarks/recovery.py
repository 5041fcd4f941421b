"""OOM recovery: how long from the OOM to the next completed step, whether memory comes back to where
it was, and whether repeated OOMs leave anything behind.

1. Real budget OOMs: the small GPT under a `memory_budget` that fits micro-batches of half the
   batch but not the whole batch. It trains at half, then "double_batch" is requested: the next
   forward crosses the budget, gputui drops the attempt and replays the batch at half. Repeated.
2. Many OOMs with auto-recover off: `step` raises torch.OutOfMemoryError after building the whole
   forward graph, every third call; a sink answers each pause with an immediate "resume". RSS
   (read fresh) and the tracked bytes after each recovery must stay flat.
"""

from __future__ import annotations

import sys
import time
from itertools import pairwise
from typing import Any

import harness

FULL = {"budget_cycles": 20, "manual_cycles": 50}
QUICK = {"budget_cycles": 4, "manual_cycles": 8}


class Recorder:
    """A hub sink noting when events and samples happen; `react(recorder, record)` runs on the training
    thread right after, e.g. to request a control."""

    def __init__(self, react: Any = None) -> None:
        self.react = react
        self.hub: Any = None
        self.events: list[tuple[float, Any]] = []
        self.samples: list[tuple[float, Any, int]] = []

    def on_event(self, event: Any) -> None:
        self.events.append((time.perf_counter(), event))
        if self.react:
            self.react(self, event)

    def on_sample(self, sample: Any) -> None:
        from gputui.probes import host

        self.samples.append((time.perf_counter(), sample, host.rss()))  # fresh: not the 0.2 s cached one
        if self.react:
            self.react(self, sample)

    def on_start(self, info: Any) -> None: ...
    def on_end(self, summary: Any) -> None: ...

    def after(self, t: float) -> tuple[float, Any, int]:
        return next(s for s in self.samples if s[0] > t)

    def before(self, t: float) -> tuple[float, Any, int]:
        return [s for s in self.samples if s[0] < t][-1]


def _fit(w: Any, device: str, rec: Recorder, steps: int, step: Any = None, **kwargs: Any) -> Any:
    """`gputui.fit` on `steps` of the workload's batches, into a fresh hub that `rec` listens to."""
    import gputui
    from gputui.telemetry import hub as hubs

    rec.hub = hubs.Hub()
    rec.hub.add_sink(rec)
    hubs.install(rec.hub)
    try:
        data = [w.batches[i % len(w.batches)] for i in range(steps)]
        return gputui.fit(w.model, data, step or w.step, w.optimizer(), device=device, **kwargs)
    finally:
        hubs.install(None)


def budget_ooms(cycles: int, device: str) -> dict[str, Any]:
    import torch
    from workloads import make

    def peak(micro: int | None) -> Any:  # tracked bytes, on the CPU: what a budget is measured in
        rec = Recorder()
        _fit(make("gpt"), "cpu", rec, 3, micro_batch=micro)
        return rec.samples[-1][1].memory

    full, half = peak(None), peak(16)
    # fits at half; at the whole batch the forward alone (the peak less the gradients) crosses it
    budget = (half.peak + full.peak - full.params) // 2
    w = make("gpt", device=device)
    ooms: list[float] = []

    def step(model: Any, batch: Any) -> Any:
        try:
            return w.step(model, batch)
        except torch.OutOfMemoryError:
            ooms.append(time.perf_counter())
            raise

    def react(rec: Recorder, record: Any) -> None:
        # after three steps at half, ask for the whole batch again
        if len(ooms) < cycles and getattr(record, "accumulation", 0) == 2 and len(rec.samples) % 4 == 0:
            rec.hub.controls.request("double_batch")

    rec = Recorder(react)
    result = _fit(w, device, rec, 4 * cycles + 8, step, micro_batch=16, memory_budget=budget)
    recovered = [(t, e) for t, e in rec.events if e.name == "oom_recovered"]
    normal = [
        b[0] - a[0]
        for a, b in pairwise(rec.samples)
        if a[1].accumulation == b[1].accumulation == 2 and not any(a[0] < t < b[0] for t in ooms)
    ]
    rows = []
    for t_oom, (t_rec, event) in zip(ooms, recovered, strict=False):
        t_done, after, rss_after = rec.after(t_rec)
        _, before, rss_before = rec.before(t_oom)
        rows.append(
            {
                "oom_to_recovered_ms": 1e3 * (t_rec - t_oom),
                "oom_to_next_step_ms": 1e3 * (t_done - t_oom),
                "phase": event.details["phase"],
                "leaked": event.details["leaked"],
                "allocated_before": before.memory.allocated,
                "allocated_after": after.memory.allocated,
                "rss_before": rss_before,
                "rss_after": rss_after,
            }
        )
    return {
        "budget": budget,
        "peak_full": full.peak,
        "peak_half": half.peak,
        "ooms": len(ooms),
        "recovered": result.ooms_recovered,
        "rows": rows,
        "oom_to_recovered_ms": harness.summary([r["oom_to_recovered_ms"] for r in rows]),
        "oom_to_next_step_ms": harness.summary([r["oom_to_next_step_ms"] for r in rows]),
        "normal_step_ms": harness.summary([1e3 * x for x in normal]),
        "phases": sorted({r["phase"] for r in rows}),
        "leaked_max": max((r["leaked"] for r in rows), default=None),
        "allocated_changed": sum(r["allocated_after"] != r["allocated_before"] for r in rows),
        "rss_growth": rows[-1]["rss_after"] - rows[0]["rss_after"] if rows else None,
    }


def manual_ooms(cycles: int, device: str) -> dict[str, Any]:
    import torch
    from workloads import make

    w = make("gpt", device=device)
    calls, ooms = [0], []

    def step(model: Any, batch: Any) -> Any:
        loss = w.step(model, batch)  # the whole forward graph exists: the OOM must free all of it
        calls[0] += 1
        if calls[0] % 3 == 0:
            ooms.append(time.perf_counter())
            raise torch.OutOfMemoryError("simulated: CUDA out of memory. Tried to allocate 2.00 GiB")
        return loss

    def react(rec: Recorder, record: Any) -> None:
        if getattr(record, "name", None) == "paused" and record.details.get("reason") == "oom":
            rec.hub.controls.request("resume")

    rec = Recorder(react)
    _fit(w, device, rec, 2 * cycles + 1, step, auto_recover=False)
    after = [rec.after(t) for t in ooms]
    rss = [a[2] for a in after]
    tracked = [a[1].memory.allocated for a in after]
    settle = min(5, len(rss) - 1)  # allocator and interpreter warm-up: compare from the 6th recovery on
    return {
        "ooms": len(ooms),
        "oom_to_next_step_ms": harness.summary([1e3 * (a[0] - t) for a, t in zip(after, ooms, strict=False)]),
        "rss": rss,
        "tracked": tracked,
        "rss_first": rss[0],
        "rss_last": rss[-1],
        "rss_growth_after_settle": rss[-1] - rss[settle],
        "rss_range_after_settle": max(rss[settle:]) - min(rss[settle:]),
        "tracked_distinct": sorted(set(tracked)),
        "settle": settle,
    }


def run(quick: bool, device: str) -> dict[str, Any]:
    device = harness.device_of(device)
    config = QUICK if quick else FULL
    from workloads import make

    out = {
        "device": device,
        "description": make("gpt").description,
        "budget": budget_ooms(config["budget_cycles"], device),
    }
    print(f"recovery: {out['budget']['oom_to_next_step_ms'].get('median')} ms to the next step", file=sys.stderr)
    out["manual"] = manual_ooms(config["manual_cycles"], device)
    return out


def markdown(r: dict[str, Any]) -> str:
    from gputui.units import format_bytes

    b, m = r["budget"], r["manual"]
    unit = "tracked bytes" if r["device"] == "cpu" else "allocated bytes"
    return "\n".join(
        [
            f"Device {r['device']}; {r['description']}.",
            "",
            f"**Budget OOMs.** Budget {format_bytes(b['budget'])}: step peak {format_bytes(b['peak_half'])} at "
            f"micro-batch 16, {format_bytes(b['peak_full'])} at 32. {b['ooms']} OOMs (in {', '.join(b['phases'])}), "
            f"{b['recovered']} recovered.",
            "",
            "| | ms: median (min-max) |",
            "| --- | --- |",
            f"| OOM raised to `oom_recovered` (frames dropped, gradients dropped, young garbage collected, the planner's pick, RNG restored) | "
            f"{harness.spread(b['oom_to_recovered_ms'])} |",
            f"| OOM raised to the next completed step (the batch replayed as 16 x 2) | {harness.spread(b['oom_to_next_step_ms'])} |",
            f"| an ordinary step at 16 x 2, for comparison | {harness.spread(b['normal_step_ms'])} |",
            "",
            f"Memory after each recovery: {unit} back to the value before the OOM in "
            f"{len(b['rows']) - b['allocated_changed']} of {len(b['rows'])} recoveries; largest `leaked` "
            f"(allocated after the drop minus before the step) {format_bytes(b['leaked_max'])}; RSS from the first to the "
            f"last recovery {format_bytes(b['rss_growth'])}.",
            "",
            f"**{m['ooms']} OOMs with auto-recover off**, each answered by an immediate resume (the step raises "
            f"`torch.OutOfMemoryError` after its forward, every third call). OOM to the next completed step: "
            f"{harness.spread(m['oom_to_next_step_ms'])} ms. After each recovery: {unit} took "
            f"{len(m['tracked_distinct'])} distinct value(s) ({', '.join(format_bytes(t) for t in m['tracked_distinct'])}); "
            f"RSS {format_bytes(m['rss_first'])} after the first, {format_bytes(m['rss_last'])} after the last; from the "
            f"{m['settle'] + 1}th to the last it moved by {format_bytes(m['rss_growth_after_settle'])} "
            f"(range {format_bytes(m['rss_range_after_settle'])}).",
            "",
        ]
    )


if __name__ == "__main__":
    harness.main(run, __doc__)
