"""A scripted Source: a recorded-looking run with fixed numbers, for snapshot tests of the screens."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from gputui.telemetry.controls import SNAPSHOT_NEEDS_CUDA, SUMMARY_NEEDS_CUDA
from gputui.telemetry.run import RunInfo
from gputui.telemetry.sample import (
    Event,
    GpuDevice,
    GpuProcess,
    GpuReading,
    HostReading,
    Memory,
    RankMemory,
    StepSample,
)
from gputui.tui.sources import Update

GiB, MiB = 2**30, 2**20
T0 = 1_795_000_000.0  # a fixed wall-clock start: timeline times are stable (with TZ=UTC)


def on_refresh(app: Any, kind: type, note: Callable[[Any, tuple[Any, ...]], None]) -> None:
    """Call `note(panel, regions)` at every refresh() of the main screen's panels of `kind`, then refresh."""
    for panel in app.main.query(kind):

        def counted(*regions: Any, _panel: Any = panel, _refresh: Any = panel.refresh, **kwargs: Any) -> Any:
            note(_panel, regions)
            return _refresh(*regions, **kwargs)

        panel.refresh = counted


class FrozenClock:
    """The app's monotonic clock: the run starts at 1000 s and it is 754 s later from then on."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> float:
        self.calls += 1
        return 1000.0 if self.calls == 1 else 1754.0


def rank_memories(count: int, peak: int, capacity: int | None, micro_batch: int) -> tuple[RankMemory, ...]:
    """`count` ranks of a torchrun job as the step's exchange gives them: rank 0 at `peak`, the others a
    whole GiB apart in a scrambled order (of 64, rank 19 is the worst, 63 GiB above rank 0); each at
    1000 samples/s, its loss 2.0 + rank / 10."""
    return tuple(
        RankMemory(r, micro_batch, peak + (r * 37 % count) * GiB, capacity, loss=2.0 + r / 10, samples_per_s=1000.0)
        for r in range(count)
    )


def cuda_sample(step: int, ranks: int = 0) -> StepSample:
    """One step of a GPT on an H100; `ranks`: the size of the torchrun job it is a rank of (0: one process)."""
    wobble = math.sin(step * 1.7)
    memory = Memory(
        device="cuda:0",
        allocated=int(9.2 * GiB + 40 * MiB * wobble),
        reserved=16 * GiB,
        fragmented=int(1.1 * GiB),
        peak=int(14.1 * GiB + 200 * MiB * wobble),
        capacity=80 * GiB,
        active=int(9.5 * GiB),
        alloc_retries=0,
        ooms=1,
        device_free=62 * GiB,
        nvml_used=int(16.6 * GiB),
        nvml_device_used=int(17.4 * GiB),
        rss=int(3.1 * GiB),
    )
    return StepSample(
        t=T0 + step,
        step=step,
        epoch=step // 250,
        loss=2.4 * math.exp(-step / 90) + 1.4 + 0.06 * wobble,
        batch_size=64,
        micro_batch=32 if step > 120 else 64,
        accumulation=2 if step > 120 else 1,
        amp="bf16",
        checkpointing=False,
        samples_per_s=2140.0,
        memory=memory,
        samples=step * 64,
        host=HostReading(rss=int(3.1 * GiB), cpu_percent=104.0, system_used=41 * GiB, system_total=251 * GiB),
        ranks=rank_memories(ranks, memory.peak, memory.capacity, 32 if step > 120 else 64) if ranks else (),
    )


def cpu_sample(step: int) -> StepSample:
    wobble = math.sin(step * 0.9)
    memory = Memory(
        device="cpu",
        allocated=int(6.15 * MiB),
        peak=int(10.8 * MiB + 0.1 * MiB * wobble),
        capacity=12 * MiB,
        params=int(2.05 * MiB),
        grads=0,
        optimizer=int(4.1 * MiB),
        activations=0,
        rss=351 * MiB,
    )
    return StepSample(
        t=T0 + step,
        step=step,
        epoch=0,
        loss=2.3 * math.exp(-step / 40) + 0.3 + 0.04 * wobble,
        batch_size=256,
        micro_batch=128,
        accumulation=2,
        amp="off",
        checkpointing=False,
        samples_per_s=10_400.0,
        memory=memory,
        samples=step * 256,
        host=HostReading(rss=351 * MiB, cpu_percent=190.0, system_used=618 * MiB, system_total=int(23.5 * GiB)),
    )


GPUS = GpuReading(
    t=T0,
    driver="580.159.04",
    devices=(
        GpuDevice(
            0,
            uuid="GPU-0",
            name="NVIDIA H100 80GB HBM3",
            utilization=97,
            memory_used=int(17.4 * GiB),
            memory_total=80 * GiB,
            temperature=61,
            power=598.0,
            power_limit=700.0,
            processes=(GpuProcess(4242, int(16.6 * GiB), "compute", "ada", "python train.py"),),
        ),
    ),
)


def info(device: str, name: str, **extra) -> RunInfo:
    fields = dict(
        device=device,
        device_name=name,
        model="GPT",
        params=124_000_000,
        epochs=4,
        total_steps=1000,
        steps_per_epoch=250,
        amp="bf16",
        auto_recover=True,
    )
    return RunInfo(**{**fields, **extra})


def cuda_events() -> list[Event]:
    return [
        Event(
            "oom_recovered",
            120,
            {
                "phase": "backward",
                "micro_batch": 64,
                "micro_batch_to": 32,
                "accumulation": 2,
                "batch_size": 64,
                "message": "CUDA out of memory. Tried to allocate 2.00 GiB",
            },
            t=T0 + 120,
        ),
        Event(
            "cache_freed",
            200,
            {
                "bytes": int(1.2 * GiB),
                "reserved_before": int(17.2 * GiB),
                "reserved_after": 16 * GiB,
                "request_id": 1,
                "latency_s": 0.012,
            },
            t=T0 + 200,
        ),
        Event("amp_changed", 230, {"from": "off", "to": "bf16", "request_id": 2, "latency_s": 0.009}, t=T0 + 230),
    ]


class FakeSource:
    watch_only = None

    def __init__(self, samples, events, info, gpus=None, summary=None) -> None:
        self.update = Update(samples, events, info, summary, gpus, runs=1)
        self.sent: list[tuple[str, object]] = []

    def poll(self) -> Update:
        update, self.update = (
            self.update,
            Update([], [], self.update.info, self.update.summary, self.update.gpus, runs=1),
        )
        return update

    def request(self, action, value=None):
        self.sent.append((action, value))
        return len(self.sent) + 100

    def push(self, samples=(), events=()) -> None:
        """More for the app's next poll, as the run goes on."""
        self.update = replace(
            self.update, samples=[*self.update.samples, *samples], events=[*self.update.events, *events]
        )


def cuda_run(steps: int = 300, ranks: int = 0, **extra) -> FakeSource:
    """A GPT on an H100; `extra`: fields of its info (a rank of a torchrun job: rank, world_size, job);
    `ranks`: every rank's memory in the samples, as fit under torchrun sends it."""
    return FakeSource(
        [cuda_sample(s, ranks) for s in range(1, steps + 1)],
        cuda_events(),
        info("cuda:0", "NVIDIA H100 80GB HBM3", **extra),
        GPUS,
    )


CPU_REFUSES = {"snapshot": SNAPSHOT_NEEDS_CUDA, "memory_summary": SUMMARY_NEEDS_CUDA}  # the session's, on a CPU


def cpu_run(steps: int = 120) -> FakeSource:
    events = [
        Event(
            "oom_recovered",
            1,
            {
                "phase": "backward",
                "micro_batch": 256,
                "micro_batch_to": 128,
                "accumulation": 2,
                "batch_size": 256,
                "message": "CPU memory budget exceeded in backward",
            },
            t=T0 + 2,
        )
    ]
    return FakeSource(
        [cpu_sample(s) for s in range(1, steps + 1)],
        events,
        info(
            "cpu",
            "CPU",
            memory_budget=12 * MiB,
            model="MLP",
            total_steps=400,
            epochs=2,
            amp="off",
            refused=CPU_REFUSES,
        ),
    )


NEEDS_FIT = "the script runs its own loop: this needs gputui.fit (README: Adopting fit)"  # engine/observe.py's
LOOP_ACTIONS = ("halve_batch", "double_batch", "set_amp", "set_checkpointing", "set_auto_recover")


def own_loop_run(steps: int = 120) -> FakeSource:
    """An own loop on a CPU without a budget: the bar is the machine's memory, the loop's keys refused."""
    samples = [cpu_sample(s) for s in range(1, steps + 1)]
    samples = [replace(s, memory=replace(s.memory, capacity=None), loss_source="backward()") for s in samples]
    refused = {**CPU_REFUSES, **dict.fromkeys(LOOP_ACTIONS, NEEDS_FIT)}
    return FakeSource(samples, [], info("cpu", "CPU", mode="observe", total_steps=None, epochs=None, refused=refused))


def plan_option(remedy, label, micro_batch, amp, checkpointing, peak, capacity, **extra) -> dict:
    """A row of a plan event, as the loop's planner sends it; fits below 90% of `capacity`."""
    parameters, optimizer = int(0.5 * GiB), 1 * GiB
    activations = max(0, peak - 2 * parameters - optimizer - 256 * MiB)
    return {
        "remedy": remedy,
        "label": label,
        "micro_batch": micro_batch,
        "accumulation": 64 // micro_batch,
        "batch_size": 64,
        "amp": amp,
        "checkpointing": checkpointing,
        "peak": peak,
        "predicted": peak - 300 * MiB,
        "phase": "backward",
        "exact": True,
        "reason": None,
        "fits": None if capacity is None else peak <= 0.9 * capacity,
        "seconds": 0.31,
        "breakdown": {
            "parameters": parameters,
            "gradients": parameters,
            "optimizer": optimizer,
            "activations": activations,
            "temporaries": 256 * MiB,
        },
    } | extra


def plan_event(step=300, capacity=80 * GiB, complete=True, rows=None, **details) -> Event:
    """The planner's table for cuda_run's settings after its OOM (micro-batch 32 x 2, bf16, no
    checkpointing); `rows`: only the first so many (a table still coming in)."""
    options = [
        plan_option("now", "as now", 32, "bf16", False, int(14.1 * GiB), capacity),
        plan_option("halve", "micro-batch 16x4", 16, "bf16", False, int(8.2 * GiB), capacity),
        plan_option("double", "micro-batch 64x1", 64, "bf16", False, int(27.9 * GiB), capacity),
        plan_option("amp", "AMP off", 32, "off", False, int(22.5 * GiB), capacity),
        plan_option(
            "amp",
            "AMP fp16",
            32,
            "fp16",
            False,
            int(14.3 * GiB),
            capacity,
            exact=False,
            reason="fp16 estimated from the measured activations",
        ),
        plan_option("checkpointing", "checkpointing on", 32, "bf16", True, int(6.3 * GiB), capacity),
        plan_option("best", "64x1 ckpt", 64, "bf16", True, int(11.9 * GiB), capacity, phase="optimizer"),
    ][:rows]
    return Event(
        "plan",
        step,
        {
            "trigger": "asked",
            "capacity": capacity,
            "correction": 300 * MiB,
            "measured": int(14.1 * GiB),
            "tracked": False,
            "complete": complete,
            "options": options,
            **details,
        },
        t=T0 + step,
    )


# A plain script with its own loop (no gputui in it), printing its loss as people do: observed.
OWN_LOOP = """
import time, torch
from torch import nn
model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(3000):
    x, y = torch.randn(16, 8), torch.randint(2, (16,))
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad(); loss.backward(); opt.step()
    print(f"step {step} loss: {loss.item():.4f}")
    time.sleep(0.01)
"""
