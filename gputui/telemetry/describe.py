"""One line of plain text for an event: the progress line, the TUI timeline and `gputui ctl` share it."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ..units import counted, format_bytes, format_pieces
from .events import EVENTS
from .sample import Event

_ACTIONS = {
    "halve_batch": "halve micro-batch",
    "double_batch": "double micro-batch",
    "set_amp": "AMP",
    "set_checkpointing": "checkpointing",
    "set_auto_recover": "auto-recover",
    "free_cache": "free cache",
    "snapshot": "snapshot",
    "top_tensors": "top tensors",
    "memory_summary": "memory summary",
    "memory_history": "memory history",  # --memory-history, refused where the allocator keeps none
    "plan": "plan",
    "pause": "pause",
    "resume": "resume",
    "stop": "stop",
}


def _on(flag: Any) -> str:
    return "on" if flag else "off"


def _cache(e: Event) -> str:
    if "reserved_before" in e.details:
        return (
            f"cache freed: {format_bytes(e['bytes'])} returned "
            f"(reserved {format_bytes(e['reserved_before'])} -> {format_bytes(e.get('reserved_after'))})"
        )
    if "rss_before" in e.details:
        return (
            f"memory freed: RSS {format_bytes(e['rss_before'])} -> {format_bytes(e.get('rss_after'))} "
            "(CPU: gc + malloc_trim; there is no allocator cache)"
        )
    return f"cache freed: {format_bytes(e['bytes'])} returned"


def _oom(e: Event) -> str:
    if e.get("diagnosis"):  # an own loop's (engine/observe.py): the script stopped there
        return f"OOM in {e['phase']} at {e.get('where', 'an unknown line')}: the script stopped"
    at = f" at micro-batch {e['micro_batch']}" if "micro_batch" in e.details else ""
    return f"OOM in {e['phase']}{at}: " + ("paused, waiting for a remedy" if e.get("waiting") else "not recoverable")


def _top(e: Event) -> str:
    rows = e.get("rows") or []
    head = ", ".join(f"{r['count']} x {tuple(r['shape'])} {r['dtype']} {format_bytes(r['bytes'])}" for r in rows[:3])
    partial = "" if e.get("complete", True) else " (scan cut short)"
    return f"top tensors: {format_bytes(e.get('total_bytes'))} in {e.get('tensors')} tensors{partial}" + (
        f"; largest {head}" if head else ""
    )


def plan_rows(e: Event) -> list[Mapping[str, Any]]:
    """A plan's options that are rows: one a newer peer or a buggy engine got wrong is skipped, as
    the progress line, the TUI and ctl must not fail on it."""
    options = e.get("options")
    return [o for o in options if isinstance(o, Mapping)] if isinstance(options, list) else []


def number(value: Any) -> float | None:
    """`value` where it is a figure (not a bool), else None: a plan's figures are shown as "?" when not."""
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _plan(e: Event) -> str:
    options = plan_rows(e)
    if not options:
        return "plan: no remedy applies"
    now = next((o for o in options if o.get("remedy") == "now"), None)
    best = next((o for o in options if o.get("remedy") == "best"), None)
    capacity = number(e["capacity"])
    of = f" of {format_bytes(capacity)}" if capacity else ""
    parts = [f"plan ({len(options)} options{'' if e['complete'] else ', more coming'})"]
    if now:
        parts.append(f"now {format_bytes(number(now.get('peak')), missing='?')}{of}")
    if best:
        parts.append(f"best {best.get('label', '?')}: {format_bytes(number(best.get('peak')), missing='?')}")
    return "; ".join(parts)


def plan_lines(e: Event) -> list[str]:
    """A plan event's options, one line each (for `gputui ctl JOB plan`): remedy, setting, predicted peak,
    its share of capacity and whether it fits, the phase of the peak, exact or why approximate."""
    capacity = number(e.get("capacity"))
    lines = []
    for o in plan_rows(e):
        peak = number(o.get("peak"))
        share = f"{peak / capacity:4.0%}" if capacity and peak is not None else "   -"
        fits = ("fits" if o["fits"] else "does not fit") if isinstance(o.get("fits"), bool) else ""
        how = "exact" if o.get("exact") else f"approx: {o.get('reason')}"
        remedy = str(o.get("remedy") or "-")
        lines.append(
            f"  {remedy:<13} {str(o.get('label', '?')):<24} {format_bytes(peak, missing='?'):>10} {share} {fits:<13} "
            f"peak in {o.get('phase', '?')}, {how}"
        )
    correction = number(e.get("correction"))
    if correction:
        lines.append(f"  (each includes a correction of {format_bytes(correction)} measured on the setting in use)")
    return lines


def waiting_text(e: Event, waited_s: float) -> str:
    """A rank waiting for others at its exchange; `waited_s`: so far (the screen counts on from the event)."""
    ranks = list(e["ranks"]) if isinstance(e["ranks"], (list, tuple)) else []
    who = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}" if ranks else "the other ranks"
    return f"waiting for {who} since step {e['at']} ({float(waited_s):.0f}s)"


def _eval(e: Event) -> str:
    value, items, ooms = number(e["value"]), number(e["items"]), number(e["ooms"])
    over = f"{items:.0f} items" if items is not None else f"{e['samples']} samples"
    replayed = f", {ooms:.0f} OOM{'s' if ooms != 1 else ''} replayed, micro-batch {e['micro_batch']}" if ooms else ""
    head = f"eval {value:.4g}" if value is not None else "eval not finite"
    return f"{head} over {e['batches']} batches ({over}, {e['seconds']:.1f} s{replayed})"


_TEXT: dict[str, Callable[[Event], str]] = {
    "rank_waiting": lambda e: waiting_text(e, e["waited_s"]),
    "rank_oom_recovered": lambda e: (
        f"rank {e['rank']} recovered from an OOM ({e['ooms']} so far); it runs micro-batch {e['micro_batch']}"
    ),
    "oom_recovered": lambda e: (
        f"OOM in {e['phase']} at micro-batch {e['micro_batch']}: "
        f"retried as {format_pieces(e['micro_batch_to'], e['accumulation'], e['batch_size'])}"
        + (f" ({e['reason']})" if e.get("reason") not in (None, "halved") else "")
    ),
    "oom": _oom,
    "micro_batch_changed": lambda e: (
        f"micro-batch {e['from']} -> {e['to']} (accumulation {e['accumulation']})"
        + (f", {e['reason']}" if e.get("reason") else "")
    ),
    "amp_changed": lambda e: f"AMP {e['from']} -> {e['to']}",
    "checkpointing_changed": lambda e: f"checkpointing {_on(e['enabled'])} ({e['how']})",
    "auto_recover_changed": lambda e: f"auto-recover {_on(e['enabled'])}",
    "cache_freed": _cache,
    "memory_limit": lambda e: (
        f"GPU memory limit {format_bytes(e['limit'])}, but {format_bytes(e['reserved'])} stays reserved by "
        "tensors made before the run: their segments are reused past the limit, and no new one is "
        "granted until this process holds less"
    ),
    "paused": lambda e: "paused" + (" after an OOM" if e.get("reason") == "oom" else ""),
    "resumed": lambda e: "resumed",
    "stopped": lambda e: f"stopped ({e['reason']})",
    "control_refused": lambda e: f"{_ACTIONS.get(e['action'], e['action'])}: not applied, {e['reason']}",
    "loss_not_finite": lambda e: f"loss is {e['loss']}",
    "step_skipped": lambda e: (
        f"step {e['at']} skipped: an inf or nan gradient under fp16, the GradScaler lowered its scale "
        f"({e['skipped']} skipped so far)"
    ),
    "batch_norm_micro_batched": lambda e: (
        f"BatchNorm now normalizes over micro-batches of {e['micro_batch']} samples, not the global batch of "
        f"{e['batch_size']}: its statistics (and running averages, updated once per micro-batch) differ from "
        "full-batch training (GroupNorm or LayerNorm would not)"
    ),
    "items_hint": lambda e: (
        f"micro-batches of {e['micro_batch']} are weighted by their samples, but the batch looks token-weighted "
        f"({e['why']}): if the loss is a mean over tokens, that gradient is not the whole batch's; "
        f"count them with fit(..., {e['fix']}) ([:, 1:] as a causal LM's loss, which skips each sequence's "
        "first label; without it for a model that does not shift its labels)"
    ),
    "fused_hint": lambda e: (
        f"fp16: the GradScaler waits for the GPU once a step (it reads whether a gradient overflowed) because "
        f"{e['optimizer']} was made without fused=True; {e['fix']} unscales and skips inside its step, without "
        "the wait"
    ),
    "thrashing": lambda e: (
        f"allocator retried for {e['steps']} steps in a row ({e['alloc_retries']} retries): "
        f"micro-batch {e['micro_batch']} -> {e['micro_batch_to']} before an OOM"
    ),
    "snapshot_saved": lambda e: (
        f"memory snapshot{' at the OOM' if e.get('reason') == 'oom' else ''}: {e['path']} "
        "(open in pytorch.org/memory_viz)"
        + (f", written in {e['seconds']:.2f} s" if isinstance(e.get("seconds"), (int, float)) else "")
        + ("" if e.get("history") else "; no history yet, recording from now on")
    ),
    "top_tensors": _top,
    "memory_summary": lambda e: "memory summary (torch.cuda.memory_summary) read",
    "plan": _plan,
    "error": lambda e: f"error: {e['message']}",
    "run_continued": lambda e: (
        "training goes on"
        + (f" ({e['total_steps']} steps in all)" if e.get("total_steps") else "")
        + (f", micro-batch {e['micro_batch']}" if e.get("micro_batch") else "")
    ),
    "part_ended": lambda e: (
        f"{'fit returned' if e['by'] == 'fit' else str(e['by']) + ' closed'} after {counted(e['steps'], 'step')} "
        f"({counted(e['samples'], 'sample')})"
    ),
    "sink_failed": lambda e: e["message"],  # "metrics file X: <error>; no more lines will be written"
    "eval": _eval,
    "signalled": lambda e: f"{e['reason']}: finishing the current step, then the script",
    "script_ended": lambda e: f"the script ended (exit code {e['code']})",
}


def describe(event: Event) -> str:
    """Every event the engine emits has its line, from the details its name promises alone (a test
    renders each with only those); one from a newer peer, or one without them, is still named."""
    required = EVENTS.get(event.name)
    if required is None or not all(key in event.details for key in required):
        return event.name.replace("_", " ")
    return _TEXT[event.name](event)  # a job's detail of another type raises: the client refuses it (checks.py)


def diagnosis_text(d: Mapping[str, Any]) -> str:
    """An OOM diagnosis (engine/observe.py) as text: what `gputui run` prints, what the TUI shows."""
    lines = [f"gputui: out of memory in {d['phase']} at {d['where']}", f"  {d['message']}"]
    m = d.get("memory") or {}
    figures = [
        f"{name} {format_bytes(m.get(key))}"
        for name, key in (
            ("allocated", "allocated"),
            ("reserved", "reserved"),
            ("fragmented", "fragmented"),
            ("step peak", "peak"),
            ("capacity", "capacity"),
        )
        if m.get(key) is not None
    ]
    if figures:
        lines.append("  memory then: " + ", ".join(figures))
    if d.get("top"):
        lines.append("  largest tensors:")
        for r in d["top"][:5]:
            shape = "x".join(map(str, r["shape"])) or "scalar"
            lines.append(f"    {format_bytes(r['bytes']):>10}  {r['count']:>4} x {shape} {r['dtype']} {r['role']}")
    lines.append("  what would fit here:")
    lines.extend(f"    - {r}" for r in d["remedies"])
    return "\n".join(lines) + "\n"
