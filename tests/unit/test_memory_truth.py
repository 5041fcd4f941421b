"""Readings the panels show: CUDA figures from a recorded memory_stats(), NVML's view, top tensors."""

import functools

import pytest
import torch
from helpers import ConvNet, conv_batches, conv_step, thrashing_allocator

import gputui
from gputui.probes import tensors
from gputui.probes.cuda import NvmlView, memory_from_stats
from gputui.probes.tensors import top_tensors
from gputui.telemetry.hub import Hub
from gputui.telemetry.sample import GpuDevice, GpuProcess, GpuReading, Memory

GiB, MiB = 2**30, 2**20

# The keys torch.cuda.memory_stats() returns (a subset, as recorded on a CUDA device mid-training);
# the probe reads them nested, as memory_stats_as_nested_dict() gives them.
RECORDED = {
    "active.all.current": 412,
    "active_bytes.all.current": 9 * GiB + 512 * MiB,
    "active_bytes.large_pool.current": 9 * GiB,
    "active_bytes.small_pool.current": 512 * MiB,
    "allocated_bytes.all.allocated": 9_000 * GiB,
    "allocated_bytes.all.current": 9 * GiB + 256 * MiB,
    "allocated_bytes.all.freed": 8_990 * GiB,
    "allocated_bytes.all.peak": 14 * GiB,
    "allocated_bytes.large_pool.current": 9 * GiB,
    "allocated_bytes.small_pool.current": 256 * MiB,
    "inactive_split_bytes.all.current": 1 * GiB + 128 * MiB,
    "inactive_split_bytes.large_pool.current": GiB,
    "num_alloc_retries": 3,
    "num_device_alloc": 120,
    "num_device_free": 40,
    "num_ooms": 1,
    "num_sync_all_streams": 3,
    "reserved_bytes.all.current": 16 * GiB,
    "reserved_bytes.all.peak": 18 * GiB,
    "reserved_bytes.large_pool.current": 15 * GiB + 768 * MiB,
    "segment.all.current": 80,
}


def nested(flat):
    """memory_stats_as_nested_dict()'s form of a memory_stats() dict (which torch flattens from it)."""
    out: dict = {}
    for key, value in flat.items():
        *path, last = key.split(".")
        node = out
        for part in path:
            node = node.setdefault(part, {})
        node[last] = value
    return out


def test_cuda_reading_from_recorded_stats():
    m = memory_from_stats(nested(RECORDED), device="cuda:0", capacity=80 * GiB, device_free=60 * GiB, rss=3 * GiB)
    assert (m.allocated, m.reserved, m.fragmented, m.peak) == (9 * GiB + 256 * MiB, 16 * GiB, GiB + 128 * MiB, 14 * GiB)
    assert (m.active, m.alloc_retries, m.ooms) == (9 * GiB + 512 * MiB, 3, 1)
    assert m.cached_free == 16 * GiB - (9 * GiB + 256 * MiB)
    assert (m.capacity, m.device_free, m.nvml_gap) == (80 * GiB, 60 * GiB, None)
    assert m.to_json()["cached_free"] == m.cached_free


def test_nvml_gap_names_what_pytorch_cannot_see():
    m = Memory("cuda:0", allocated=10 * GiB, reserved=12 * GiB, nvml_used=12 * GiB + 530 * MiB)
    assert m.nvml_gap == 530 * MiB  # the CUDA context and workspaces outside the caching allocator


def carrying(reading):
    """A hub that has carried one GPU reading, as the NVML poller feeds it."""
    hub = Hub()
    hub.publish_gpus(reading)
    return hub


def test_nvml_view_reads_this_process_or_only_the_device_in_a_container():
    mine = GpuProcess(pid=4242, gpu_memory=13 * GiB, kind="compute")
    other = GpuProcess(pid=7, gpu_memory=2 * GiB, kind="compute")
    reading = GpuReading(
        t=0.0, devices=(GpuDevice(0, memory_used=5 * GiB), GpuDevice(1, memory_used=15 * GiB, processes=(mine, other)))
    )
    assert NvmlView(carrying(reading), 1, 4242).used() == {"nvml_used": 13 * GiB, "nvml_device_used": 15 * GiB}
    hidden = GpuReading(t=0.0, devices=(GpuDevice(0, memory_used=5 * GiB),))  # PIDs hidden from NVML
    assert NvmlView(carrying(hidden), 0, 4242).used() == {"nvml_used": None, "nvml_device_used": 5 * GiB}
    assert NvmlView(carrying(GpuReading(t=0.0, status="no NVIDIA driver is loaded")), 0, 1).used() == {}
    assert NvmlView(Hub(), 0, 1).used() == {}  # no reading yet


def test_top_tensors_groups_roles_and_shared_storage():
    model = torch.nn.Linear(256, 512)
    model(torch.randn(3, 256)).sum().backward()
    big = torch.zeros(1024, 1024)
    views = [big[:10], big[10:20]]  # share big's storage: it counts once
    # A budget no loaded CI machine reaches: what is checked here is the grouping (the budget has its own test).
    grads = [p.grad for p in model.parameters()]
    report = top_tensors(params=list(model.parameters()), grads=grads, limit=10_000, time_budget=60.0)
    rows = report["rows"]
    assert [r["bytes"] for r in rows] == sorted((r["bytes"] for r in rows), reverse=True)
    assert {
        "shape": [1024, 1024],
        "dtype": "float32",
        "device": "cpu",
        "role": "other",
        "count": 1,
        "bytes": 4 * MiB,
    } in rows
    weight = next(r for r in rows if r["shape"] == [512, 256] and r["role"] == "parameter")
    grad = next(r for r in rows if r["shape"] == [512, 256] and r["role"] == "gradient")
    assert weight["bytes"] == grad["bytes"] == 512 * 256 * 4
    view_rows = [r for r in report["rows"] if r["shape"] == [10, 1024]]
    assert view_rows and view_rows[0]["count"] >= 2 and view_rows[0]["bytes"] == 0
    assert report["complete"] and report["total_bytes"] >= 4 * MiB and report["tensors"] >= 6
    del views


def test_top_tensors_stops_at_its_time_budget():
    report = top_tensors(time_budget=0.0)
    assert report["complete"] is False and report["scanned"] == 0


def test_top_tensors_show_what_fit_keeps_to_replay_a_step_as_its_own(hub, monkeypatch):
    """The generators' states and the running statistics' copies are gputui's memory, not the script's
    "other" tensors. Every row is read: tensors the earlier tests of a worker left alive outrank the
    8-byte step-counter copies in a top 20."""
    monkeypatch.setattr(tensors, "top_tensors", functools.partial(tensors.top_tensors, limit=100_000))
    model = ConvNet(batch_norm=True)

    def batches():
        first, second = conv_batches(2, 4)
        yield first
        hub.controls.request("top_tensors")  # after a step: its start's states are kept
        yield second

    result = gputui.fit(model, batches(), conv_step, torch.optim.Adam(model.parameters()))
    rows = next(e for e in result.events if e.name == "top_tensors")["rows"]
    rng = torch.default_generator.get_state()
    ours = [r for r in rows if r["role"] == "gputui replay"]
    assert {"shape": list(rng.shape), "dtype": "uint8", "count": 1} in [
        {k: r[k] for k in ("shape", "dtype", "count")} for r in ours
    ], rows
    stats = [b for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d) for b in m.buffers()]
    # the state and a copy of each buffer (a tensor has one role: these are not among "other" then)
    assert sum(r["count"] for r in ours) == 1 + len(stats), ours


def test_top_tensors_and_snapshot_controls_on_cpu(hub):
    model = ConvNet()
    hub.controls.request("top_tensors")
    hub.controls.request("snapshot")
    result = gputui.fit(model, conv_batches(2, 4), conv_step, torch.optim.Adam(model.parameters()))
    top, refused = result.events
    assert top.name == "top_tensors" and any(r["role"] == "parameter" for r in top["rows"])
    assert refused.name == "control_refused" and refused["action"] == "snapshot"
    assert refused["reason"].startswith("memory snapshots are a CUDA allocator feature")


def test_gpu_memory_limit_needs_cuda():
    model = ConvNet()
    with pytest.raises(ValueError, match="gpu_memory_limit needs a CUDA device"):
        gputui.fit(
            model, conv_batches(1, 2), conv_step, torch.optim.SGD(model.parameters(), lr=0.1), gpu_memory_limit="8GiB"
        )


def test_host_readings_ride_on_the_samples(hub):
    model = ConvNet()
    gputui.fit(model, conv_batches(2, 4), conv_step, torch.optim.SGD(model.parameters(), lr=0.1))
    host = hub.latest().host
    assert host.rss > 10 * MiB and host.system_total > host.system_used > 0 and host.cpu_percent >= 0


def test_thrashing_allocator_triggers_a_preemptive_halving(hub, monkeypatch):
    thrashing_allocator(monkeypatch)
    model = ConvNet()
    result = gputui.fit(model, conv_batches(6, 8), conv_step, torch.optim.SGD(model.parameters(), lr=0.1))
    thrash = [e for e in result.events if e.name == "thrashing"]
    assert [(e.step, e["micro_batch"], e["micro_batch_to"]) for e in thrash] == [(4, 8, 4)]
    assert result.micro_batch == 4 and result.steps == 6
