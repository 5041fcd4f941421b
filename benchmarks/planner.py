"""What-if planner: how long one prediction takes per model and remedy, how close the predicted step
peak comes to the one the step then measures, and what a plan asked for mid-run costs the training.

Each model trains one step first (its optimizer holds state, as at every later step). For each remedy
`gputui.plan.predict` runs a few times (the median is shown), then `gputui.fit` trains one step under
that remedy and gputui's CPU tracker counts its peak (parameters, gradients, optimizer state, saved
activations), the figure `Prediction.tracked_peak` predicts. With `--device cuda` and a GPU, the same
runs on it: `Prediction.peak` against `max_memory_allocated` and `max_memory_reserved`; the error is
taken against the peak less what was allocated outside the training state before the step (the cuBLAS
workspaces, 64 MiB on an H200, which no trace sees; a run's correction adds them after its first step),
the figure `max_memory_allocated` would reach for the step alone. The slowdown: a
fit run where the `plan` control is requested mid-run; the planner traces the table at step
boundaries on the training thread (for planning.ASKED_S, then planning.BOUNDARY_S each), which
stretches those steps.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable
from itertools import pairwise
from typing import Any

import harness

sys.path.insert(0, os.path.join(harness.ROOT, "tests"))  # the conv net with BatchNorm the tests train

REPEATS = {"full": 3, "quick": 1}
SLOWDOWN = {"full": {"steps": 40, "ask_at": 10}, "quick": {"steps": 16, "ask_at": 4}}
BUDGET = 1 << 30  # far above every peak here: every step counted, the table's best row the whole batch


def models(device: str) -> list[tuple[str, Callable[[], tuple[Any, Any, Any, int]]]]:
    """(description, make): make() gives a fresh model (same weights each time), one batch on `device`,
    the step and the batch size."""
    import torch
    from helpers import ConvNet, conv_step
    from workloads import demo_mlp, make

    from gputui.step.microbatch import to_device

    def mlp() -> tuple[Any, Any, Any, int]:
        torch.manual_seed(0)
        width, depth = demo_mlp.SIZES["small"]
        batch = (torch.randn(256, 64), torch.randint(10, (256,)))
        return demo_mlp.MLP(64, width, depth, 10).to(device), to_device(batch, torch.device(device)), demo_mlp.step, 256

    def gpt() -> tuple[Any, Any, Any, int]:
        w = make("gpt", device=device, distinct=1)
        return w.model, w.batches[0], w.step, w.batch_size

    def conv() -> tuple[Any, Any, Any, int]:
        torch.manual_seed(0)
        batch = (torch.randn(32, 3, 16, 16), torch.randint(5, (32,)))
        model = ConvNet(channels=32, blocks=4, batch_norm=True).to(device)
        return model, to_device(batch, torch.device(device)), conv_step, 32

    found = [
        (
            f"demos/mlp.py small (width {demo_mlp.SIZES['small'][0]}, depth {demo_mlp.SIZES['small'][1]}), batch 256",
            mlp,
        ),
        (make("gpt", distinct=1).description.replace(", AdamW", ""), gpt),
        ("conv net with BatchNorm (tests/helpers.py, 32 channels, 4 blocks), batch 32 of 3x16x16", conv),
    ]
    try:
        import transformers
    except ImportError:
        return found

    def gpt2() -> tuple[Any, Any, Any, int]:
        torch.manual_seed(0)
        config = transformers.GPT2Config(
            vocab_size=256, n_positions=32, n_embd=64, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0
        )
        tokens = torch.randint(256, (16, 32), device=device)
        return transformers.GPT2LMHeadModel(config).to(device), {"input_ids": tokens, "labels": tokens}, gpt2_step, 16

    found.append((f"Hugging Face GPT2LMHeadModel tiny (transformers {transformers.__version__}), batch 16", gpt2))
    return found


def gpt2_step(model: Any, batch: Any) -> Any:
    return model(**batch).loss


def remedies(size: int) -> list[tuple[str, dict[str, Any]]]:
    return [
        ("as started (whole batch)", {}),
        (f"micro-batch halved ({size // 2} x 2)", {"micro_batch": size // 2}),
        ("AMP bf16", {"amp": "bf16"}),
        ("AMP fp16 (GradScaler)", {"amp": "fp16"}),
        ("checkpointing", {"checkpointing": True}),
        (f"{size // 4} x 4, bf16, checkpointing", {"micro_batch": size // 4, "amp": "bf16", "checkpointing": True}),
    ]


def one_step(model: Any, optimizer: Any, batch: Any, step: Any, device: str, **settings: Any) -> dict[str, Any]:
    """One fit step into a fresh hub: the peak it measured (the tracker's on a CPU; on CUDA the step's
    max_memory_allocated and max_memory_reserved, and what was allocated outside the training state before it)."""
    import torch

    import gputui
    from gputui.plan.predictions import outside as held_outside
    from gputui.telemetry import hub as hubs

    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)  # reserved's peak too (fit resets allocated's each step)
        outside = held_outside(model, optimizer, torch.device(device))
    hub = hubs.Hub()
    hubs.install(hub)
    try:
        gputui.fit(model, [batch], step, optimizer, device=device, memory_budget=None if cuda else BUDGET, **settings)
    finally:
        hubs.install(None)
    if cuda:
        return {
            "allocated": torch.cuda.max_memory_allocated(device),
            "reserved": torch.cuda.max_memory_reserved(device),
            "outside": outside,
        }
    return {"tracked": hub.samples()[-1].memory.peak}


def accuracy(description: str, make: Any, device: str, repeats: int) -> dict[str, Any]:
    """Every remedy of one model on one device: prediction times, predicted and measured peaks."""
    import torch

    from gputui import plan

    model, batch, step, size = make()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    one_step(model, optimizer, batch, step, device)
    rows = []
    for label, settings in remedies(size):
        times, p = [], None
        for _ in range(repeats):
            t0 = time.perf_counter()
            p = plan.predict(model, optimizer, batch, step, **settings)
            times.append(time.perf_counter() - t0)
        assert p is not None
        measured = one_step(model, optimizer, batch, step, device, **settings)
        rows.append(
            {
                "remedy": label,
                "settings": settings,
                "predict_ms": harness.summary([1e3 * t for t in times]),
                "tracked_peak": p.tracked_peak,
                "peak": p.peak,
                "phase": p.phase,
                "exact": p.exact,
                "breakdown": p.breakdown,
                **measured,
            }
        )
        print(f"planner {description[:40]} {label}: {rows[-1]}", file=sys.stderr)
    return {"model": description, "device": device, "rows": rows}


def slowdown(description: str, make: Any, steps: int, ask_at: int) -> dict[str, Any]:
    """A fit run (CPU, budget far above) asked for a plan after step `ask_at`: each step's time, and the
    steps whose boundary traced part of the table."""
    import torch
    from helpers import RequestAt

    import gputui
    from gputui.telemetry import hub as hubs

    model, batch, step, size = make()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    hub = hubs.Hub()
    hubs.install(hub)
    hub.add_sink(RequestAt(hub, ask_at, "plan"))
    try:
        result = gputui.fit(model, [batch] * steps, step, optimizer, memory_budget=BUDGET)
    finally:
        hubs.install(None)
    samples = hub.samples()
    plans = [e for e in result.events if e.name == "plan"]
    if not plans or not plans[-1]["complete"]:
        raise RuntimeError(f"{description}: no complete plan in {steps} steps ({len(plans)} plan events)")
    # Step k+1 starts at the boundary after step k: the planner traces there before training it. The
    # first boundary answers the request (an event), the middle ones trace silently, the last completes.
    tracing = set(range(plans[0].step + 1, plans[-1].step + 2))
    ms = {b.step: 1e3 * (b.t - a.t) for a, b in pairwise(samples)}
    normal = statistics.median(v for k, v in ms.items() if k not in tracing and k > 2)
    traced = {k: ms[k] for k in sorted(tracing) if k in ms}
    table = plans[-1]["options"]
    distinct = {(o["micro_batch"], o["amp"], o["checkpointing"]): o["seconds"] for o in table}
    return {
        "model": description,
        "steps": steps,
        "ask_at": ask_at,
        "batch_size": size,
        "step_ms": normal,
        "tracing_steps_ms": traced,
        "extra_s": sum(v - normal for v in traced.values()) / 1e3,
        "options": len(table),
        "predictions": len(distinct),
        "traces_s": sum(distinct.values()),
    }


def run(quick: bool, device: str) -> dict[str, Any]:
    import torch

    device = harness.device_of(device)
    mode = "quick" if quick else "full"
    start, load = harness.cpu_jiffies(), os.getloadavg()[0]
    cases = models("cpu")
    t0 = time.perf_counter()
    from gputui import plan
    from gputui.plan import planner as planning

    first = cases[0][1]()  # the first prediction of a process imports and warms the fake-tensor machinery
    plan.predict(first[0], torch.optim.AdamW(first[0].parameters()), first[1], first[2])
    warmup_s = time.perf_counter() - t0
    cpu = [accuracy(d, make, "cpu", REPEATS[mode]) for d, make in cases]
    cuda = (
        [accuracy(d, make, device, REPEATS[mode]) for d, make in models(device)] if device.startswith("cuda") else None
    )
    slow = [slowdown(d, make, **SLOWDOWN[mode]) for d, make in cases[:2]]
    from run import machine

    return {
        "machine": machine(device),  # said in the section too: it may be run alone and spliced in
        "device": device,
        "gpu": torch.cuda.get_device_name(device) if device.startswith("cuda") else None,
        "torch_threads": torch.get_num_threads(),
        "load_1min": [load, os.getloadavg()[0]],
        "steal_pct": harness.steal_since(start),
        "first_prediction_s": warmup_s,
        "boundary_s": {"asked": planning.ASKED_S, "later": planning.BOUNDARY_S},
        "repeats": REPEATS[mode],
        "cpu": cpu,
        "cuda": cuda,
        "slowdown": slow,
    }


def _pct(predicted: int, measured: int | None) -> str:
    return "n/a" if not measured else f"{100 * (predicted - measured) / measured:+.2f}%"


def markdown(r: dict[str, Any]) -> str:
    from gputui.units import format_bytes

    errors = [abs(row["tracked_peak"] - row["tracked"]) / row["tracked"] for m in r["cpu"] for row in m["rows"]]
    times = [row["predict_ms"]["median"] for m in r["cpu"] for row in m["rows"]]
    gpu = (
        f"CUDA: {r['gpu']}."
        if r["cuda"]
        else "no GPU: the CUDA columns (the predicted live peak against `max_memory_allocated` and "
        "`max_memory_reserved`) are not measured."
    )
    m = r["machine"]
    lines = [
        f"Device cpu ({m['cpu']}, {m['cores']} cores; torch {m['torch']} on {r['torch_threads']} threads; "
        f"{m['date']}, commit {m['commit']}); {gpu} Load average {r['load_1min'][0]:.1f} at the start, {r['load_1min'][1]:.1f} at the end; "
        f"machine time stolen by the hypervisor {harness.fmt(r['steal_pct'], 2)}% (a shared machine: times are not from a "
        "quiet one).",
        "",
        f"**Accuracy**: predicted tracker peak within **{100 * max(errors):.2f}%** of the measured one in all "
        f"{len(errors)} cases (the tests ask for 5%); a prediction took {harness.fmt(min(times))}-"
        f"{harness.fmt(max(times))} ms (median of {r['repeats']} each; the first of a process "
        f"{1e3 * r['first_prediction_s']:.0f} ms, importing the fake-tensor machinery). Live peak: every storage "
        "alive at once (temporaries too), what a GPU's allocator would hold; phase: where that peak falls.",
        "",
    ]
    cuda = {m["model"]: m["rows"] for m in r["cuda"] or []}
    head = "| remedy | prediction (ms) | predicted tracker peak | measured tracker peak | error | predicted live peak | phase |"
    rule = "| --- | --- | --- | --- | --- | --- | --- |"
    if cuda:
        head += " CUDA predicted | max allocated | outside the trace | error | max reserved |"
        rule += " --- | --- | --- | --- | --- |"
    for m in r["cpu"]:
        lines += [f"**{m['model']}**, AdamW:", "", head, rule]
        for i, row in enumerate(m["rows"]):
            cells = [
                row["remedy"],
                harness.spread(row["predict_ms"]),
                format_bytes(row["tracked_peak"]),
                format_bytes(row["tracked"]),
                _pct(row["tracked_peak"], row["tracked"]),
                format_bytes(row["peak"]),
                row["phase"] + ("" if row["exact"] else " (approx)"),
            ]
            if cuda:
                c = cuda[m["model"]][i]
                cells += [
                    format_bytes(c["peak"]),
                    format_bytes(c["allocated"]),
                    format_bytes(c["outside"]),
                    _pct(c["peak"], c["allocated"] - c["outside"]),
                    format_bytes(c["reserved"]),
                ]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    lines += [
        "**Training while a plan is made** (CPU, AdamW, the same batch each step): `plan` requested mid-run; the "
        "table (every remedy that applies, and the best fit) is traced at the next step boundaries on the "
        f"training thread: the first (which answers the request) stops tracing after {r['boundary_s']['asked']} s, "
        f"each later one after {r['boundary_s']['later']} s, and a trace under way finishes.",
        "",
        "| model | step (median, ms) | plan asked after step | boundaries that traced | those steps (ms) | "
        "training time added (s) | predictions in the table | sum of their traces (s) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for s in r["slowdown"]:
        traced = ", ".join(harness.fmt(v) for v in s["tracing_steps_ms"].values())
        lines.append(
            f"| {s['model']} | {harness.fmt(s['step_ms'])} | {s['ask_at']} | {len(s['tracing_steps_ms'])} | {traced} | "
            f"{harness.fmt(s['extra_s'])} | {s['predictions']} ({s['options']} rows) | {harness.fmt(s['traces_s'])} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    harness.main(run, __doc__)
