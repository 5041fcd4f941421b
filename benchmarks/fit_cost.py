"""What fit adds to a step, and which of its parts add it: fit and a plain loop interleaved step by step in
one process (workloads.Interleaved), once as fit is and once with each per-step part of fit stood in for
by a no-op, in turns, so a slow spell of the machine falls on every variant.

    python benchmarks/fit_cost.py --device cuda --json OUT     # a stage of benchmarks/gpu_check.py
    python benchmarks/fit_cost.py --device cpu --quick

On a GPU a launch-bound step (torch limited to one thread, as a training process on a GPU machine
leaves the other cores to its data loaders) pays for each CUDA runtime call fit makes a step: the
memory read (the allocator's nested stats dict, the peak reset), the loss's copy to the host, the
generators' states saved for a replay. On a CPU the parts are the CPU tracker's step (the batch's shapes
keyed, the step's start and end), the generators, the loss read, the boundary and the row published.
The variants say what each costs; the parts they stand in for are named in PARTS. A variant's figures are only a guide to a part's cost: without it fit is not
correct (no replay, no memory panel), which is why it is no option of fit.
"""

from __future__ import annotations

import contextlib
import io
import statistics
from collections.abc import Callable, Iterator
from typing import Any

import harness
import torch
from workloads import Interleaved, fit_loop, make

from gputui.engine import boundary, deferred, oom, runner, session
from gputui.probes import cuda


def _first_reading(real: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """The probe's first reading, given again: the steps read no memory."""
    readings: dict[int, Any] = {}

    def read(probe: Any) -> Any:
        if id(probe) not in readings:
            readings[id(probe)] = real(probe)
        return readings[id(probe)]

    return read


def _nothing(real: Callable[..., Any]) -> Callable[..., Any]:
    return lambda *args, **kwargs: None


def _copy_only(real: Callable[..., Any]) -> Callable[..., Any]:
    """The loss copied to the host with no event recorded after it (and none asked: read at once, whatever
    has landed): what the copy costs against its event."""

    def start(copy: Any, loss: torch.Tensor) -> None:
        copy.host.copy_(loss.reshape(()), non_blocking=True)

    return start


def _host_generators_only(real: Callable[..., Any]) -> Callable[..., Any]:
    """The generators saved but the device's (torch's CPU one, Python's and NumPy's still)."""

    def start(generators: Any) -> None:
        generators._kind = "host"  # no "cuda": its state is not saved
        real(generators)

    return start


def _tracker_started_once(real: Callable[..., Any]) -> Callable[..., Any]:
    """The CPU tracker's step start on a run's first step only: the steps after it key no batch and count
    nothing (its figures stay the first step's)."""

    def start(run: Any, batch: Any, size: int) -> None:
        if run.tracker is None or not getattr(run, "_started_once", False):
            run._started_once = True
            real(run, batch, size)
            return
        run.tracker.counting = False
        if run.probe.start_step is not None:  # the CUDA probe's peak reset (CPU: none)
            run.probe.start_step()

    return start


PARTS: dict[str, list[tuple[Any, str, Callable[[Callable[..., Any]], Callable[..., Any]]]]] = {
    "memory read": [(cuda.CudaProbe, "read", _first_reading)],
    "peak reset": [(cuda.CudaProbe, "start_step", _nothing)],
    "loss copy": [(deferred.DeferredLoss, "put", lambda real: lambda self, value, then=None: self.latest)],
    "loss event": [
        (deferred.CudaCopy, "start", _copy_only),
        (deferred.CudaCopy, "done", lambda real: lambda self: True),
    ],
    "generators": [(oom.Generators, "start", _nothing), (oom.Generators, "end", _nothing)],
    "device generator": [(oom.Generators, "start", _host_generators_only)],
    "cpu tracker": [(runner.Runner, "start", _tracker_started_once)],
    "boundary": [(boundary.Boundary, "passed", lambda real: lambda self, batch: True)],
    "row": [(session.RunSession, "publish", _nothing)],
}
"""Each per-step part of fit: (owner, method, the stand-in made from the real method) for the variant that
trains without it. On a CPU the CUDA probe's parts are not called, nor the tracker on CUDA (without a
memory budget): those variants are fit as is."""


@contextlib.contextmanager
def without(parts: list[str]) -> Iterator[None]:
    saved = [(owner, name, owner.__dict__[name]) for part in parts for owner, name, _ in PARTS[part]]
    try:
        for part in parts:
            for owner, name, stand_in in PARTS[part]:
                setattr(owner, name, stand_in(owner.__dict__[name]))
        yield
    finally:
        for owner, name, real in saved:
            setattr(owner, name, real)


WORKLOADS = {"mlp-b832": ("mlp", 832), "gpt": ("gpt", None)}
VARIANTS = {
    "fit": [],
    **{f"without {part}": [part] for part in PARTS},
    "without all": ["memory read", "peak reset", "loss copy", "generators", "cpu tracker", "boundary", "row"],
}


def measure(name: str, device: str, rounds: int, steps: int, warmup: int) -> dict[str, Any]:
    model, batch = WORKLOADS[name]
    w = make(model, device=device, batch=batch)
    added: dict[str, list[float]] = {v: [] for v in VARIANTS}
    plain: list[float] = []
    for _ in range(rounds):
        for variant, parts in VARIANTS.items():
            data = Interleaved(w, warmup + steps)
            with without(parts), contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                fit_loop(w, data)
            p, f = data.plain[warmup:-1], data.fit[warmup:]
            plain.append(statistics.median(p))
            added[variant].append(statistics.median([b - a for a, b in zip(p, f, strict=True)]))
    step = statistics.median(plain)
    return {
        "description": w.description,
        "plain_ms": 1e3 * step,
        "added_us": {v: harness.summary([1e6 * x for x in xs]) for v, xs in added.items()},
        "ratio": {v: step / (step + statistics.median(xs)) for v, xs in added.items()},
    }


def run(quick: bool, device: str) -> dict[str, Any]:
    device = harness.device_of(device)
    torch.set_num_threads(1)
    rounds, steps, warmup = (1, 30, 5) if quick else (3, 200, 20)
    out: dict[str, Any] = {"device": device, "threads": 1, "rounds": rounds, "steps": steps, "workloads": {}}
    for name in WORKLOADS:
        n = steps if name != "gpt" else max(steps // 5, 20)  # a GPT step is ~3x the MLP's
        out["workloads"][name] = measure(name, device, rounds, n, warmup)
    return out


if __name__ == "__main__":
    harness.main(run, __doc__)
