"""On a real GPU: the readings agree with the allocator, and the CUDA-only paths work end to end.

Run through the device tool when a GPU is lent: `pytest -m gpu tests/gpu`.
"""

import math
import os
import threading

import pytest
import torch
from helpers import (
    ConvNet,
    Tiny,
    assert_same_weights,
    conv_batches,
    conv_step,
    fp16_clipped_loop,
    overflowing,
    plain_loop,
    twins,
)
from torch import nn

import gputui
from gputui.probes.cuda import CudaProbe
from gputui.probes.nvml import NvmlPoller, cuda_to_nvml_index

pytestmark = pytest.mark.gpu
MiB, GiB = 2**20, 2**30


def test_readings_match_the_allocator():
    device = torch.device("cuda", torch.cuda.current_device())
    probe = CudaProbe(device)
    probe.start_step()
    x = torch.empty(256 * MiB, dtype=torch.uint8, device=device)
    y = torch.empty(64 * MiB, dtype=torch.uint8, device=device)
    del y
    m = probe.read()
    assert m.allocated == torch.cuda.memory_allocated(device)
    assert m.reserved == torch.cuda.memory_reserved(device)
    assert m.peak == torch.cuda.max_memory_allocated(device) >= 320 * MiB
    assert m.cached_free >= 64 * MiB and m.capacity == m.device_free + m.reserved  # what this process can have
    assert m.capacity < torch.cuda.get_device_properties(device).total_memory  # the context is not ours to fill
    freed = probe.free_cache()
    assert freed["bytes"] >= 64 * MiB and freed["reserved_after"] == torch.cuda.memory_reserved(device)
    del x


def test_gpu_memory_limit_recovers_real_ooms_with_same_weights():
    batches = [(b[0].repeat(1, 1, 40, 40), b[1]) for b in conv_batches(4, 64)]
    ref, model = twins(lambda: ConvNet(channels=64, blocks=6))
    ref.cuda()
    plain_loop(
        ref, [(x.cuda(), y.cuda()) for x, y in batches], conv_step, lambda m: torch.optim.SGD(m.parameters(), lr=0.01)
    )
    limit = torch.cuda.memory_allocated() + 600 * MiB
    result = gputui.fit(
        model, batches, conv_step, torch.optim.SGD(model.parameters(), lr=0.01), device="cuda", gpu_memory_limit=limit
    )
    assert result.ooms_recovered >= 1 and result.steps == 4
    assert_same_weights(model, ref, atol=1e-4, rtol=1e-3)


def test_snapshot_written_on_request_and_at_oom(tmp_path, hub):
    model = ConvNet(channels=32)
    hub.controls.request("snapshot")
    gputui.fit(
        model,
        conv_batches(3, 16),
        conv_step,
        torch.optim.SGD(model.parameters(), lr=0.01),
        device="cuda",
        snapshot_dir=tmp_path,
    )
    saved = [e for e in hub.events() if e.name == "snapshot_saved"]
    assert saved and os.path.getsize(saved[0]["path"]) > 0
    assert "PyTorch CUDA memory summary" in open(saved[0]["summary_path"]).read()


def test_nvml_sees_this_process_and_the_gap_is_positive():
    device = torch.device("cuda", torch.cuda.current_device())
    props = torch.cuda.get_device_properties(device)
    index = cuda_to_nvml_index(device.index, cuda_uuid=str(getattr(props, "uuid", "")) or None)
    assert index is not None
    x = torch.empty(512 * MiB, dtype=torch.uint8, device=device)
    from gputui.probes.cuda import NvmlView
    from gputui.telemetry.hub import Hub

    hub, first = Hub(), threading.Event()

    def carry(reading):
        hub.publish_gpus(reading)
        first.set()

    with NvmlPoller(interval=0.25, on_reading=carry):
        assert first.wait(5), "no NVML reading in 5 s"
        used = NvmlView(hub, index, os.getpid()).used()
    assert used["nvml_device_used"] >= 512 * MiB
    if used["nvml_used"] is not None:  # PIDs may be hidden in a container
        assert used["nvml_used"] - torch.cuda.memory_reserved(device) > 0  # the CUDA context at least
    del x


def test_amp_modes_on_gpu_train():
    for amp in ("bf16", "fp16"):
        torch.manual_seed(0)
        model = ConvNet()
        result = gputui.fit(
            model,
            conv_batches(6, 8) * 3,
            conv_step,
            torch.optim.Adam(model.parameters(), lr=1e-2),
            device="cuda",
            amp=amp,
        )
        assert result.amp == amp and result.steps == 18


def test_gpu_memory_limit_from_the_command_line_reaches_a_fit_script_built_on_the_cpu(tmp_path):
    """The optimizer is made while the model is still on the CPU (fit moves it): the observer must not
    refuse the limit there, and fit applies it on the GPU."""
    import json
    import textwrap

    from process import gputui

    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent("""
        import torch
        from torch import nn
        import gputui
        model = nn.Linear(64, 64)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        data = [torch.randn(32, 64) for _ in range(3)]
        gputui.fit(model, data, lambda m, x: m(x).pow(2).mean(), opt, device="cuda")
        """)
    )
    flags = ["--gpu-memory-limit", "1GiB", "--metrics", "m.jsonl"]
    done = gputui("run", "--headless", *flags, script, cwd=tmp_path, env={**os.environ, "GPUTUI_NO_SOCKET": "1"})
    assert done.returncode == 0, done.stderr
    steps = [r for r in map(json.loads, (tmp_path / "m.jsonl").read_text().splitlines()) if r["kind"] == "step"]
    assert len(steps) == 3 and {s["memory"]["capacity"] for s in steps} == {2**30}


@pytest.mark.parametrize("amp", ["off", "bf16"])
def test_predicted_peak_matches_max_memory_allocated(amp):
    """The planner's trace on fake CUDA tensors against the allocator's peak for the same step."""
    from gputui.plan import predict

    device = torch.device("cuda", torch.cuda.current_device())
    model = ConvNet(channels=64, blocks=6).to(device)
    opt = torch.optim.AdamW(model.parameters())
    batch = tuple(t.to(device) for t in conv_batches(1, 64)[0])
    batch = (batch[0].repeat(1, 1, 16, 16), batch[1])
    gputui.fit(model, [batch], conv_step, opt, device=device)  # the optimizer's state exists
    predicted = predict(model, opt, batch, conv_step, micro_batch=16, amp=amp)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(device)
    gputui.fit(model, [batch], conv_step, opt, device=device, micro_batch=16, amp=amp)
    measured = torch.cuda.max_memory_allocated(device)
    assert predicted.exact
    # cuBLAS/cuDNN workspaces go through the caching allocator too and the trace cannot see them
    assert abs(predicted.peak - measured) <= 0.05 * measured + 64 * MiB, (predicted.peak, measured)


def test_steps_do_not_synchronise_with_the_device(hub):
    """Every step after the first runs under sync debug mode "error": the loss and the gradient norm reach
    the host through pinned memory behind an event (engine/deferred.py), and nothing else in the step
    (clipping included) waits for the GPU.
    The first step is outside it (lazy initialisation), and so is fit's return, which waits for the
    last loss: that one is exact."""
    torch.manual_seed(0)
    model = ConvNet(channels=32).cuda()
    batches = [(x.cuda(), y.cuda()) for x, y in conv_batches(8, 16)]
    computed = []

    def step(model, batch):
        loss = conv_step(model, batch)
        computed.append(loss.detach())
        return loss

    def strict():
        for i, batch in enumerate(batches):
            torch.cuda.set_sync_debug_mode("error" if i else "default")
            yield batch
        torch.cuda.set_sync_debug_mode("default")

    try:
        result = gputui.fit(
            model,
            strict(),
            step,
            torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
            device="cuda",
            clip_grad_norm=0.5,  # the norm is measured and clipped without waiting for the GPU either
        )
    finally:
        torch.cuda.set_sync_debug_mode("default")
    losses = [t.item() for t in computed]
    assert result.steps == 8 and result.loss == losses[-1]
    assert {s.loss for s in hub.samples()} <= {None, *losses}  # a step late or more, never made up


def test_clipping_under_fp16_equals_torchs_amp_recipe_and_counts_the_skipped_step(hub):
    """On CUDA the norm is read a step late (engine/deferred.py): the skipped step is still counted and
    said by the run's end, and the weights are those of torch's AMP recipe with clip_grad_norm_."""
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, 4, generator=g).cuda(), torch.randn(8, 1, generator=g).cuda()) for _ in range(6)]
    ref, model = twins(Tiny)
    ref.cuda()
    expected = fp16_clipped_loop(ref, batches, overflowing(2), torch.optim.SGD(ref.parameters(), lr=0.5), 0.5)
    assert [math.isfinite(n) for n in expected] == [True, False, True, True, True, True]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    result = gputui.fit(model, batches, overflowing(2), optimizer, amp="fp16", clip_grad_norm=0.5, device="cuda")
    assert_same_weights(model, ref)
    assert [(e["at"], e["skipped"]) for e in result.events if e.name == "step_skipped"] == [(2, 1)]
    published = [n for n in (s.grad_norm for s in hub.samples()) if n is not None and math.isfinite(n)]
    assert published and all(any(math.isclose(n, e, rel_tol=1e-5) for e in expected) for n in published)


def test_capacity_counts_what_this_process_holds_once(monkeypatch):
    """Free + reserved: a segment this process holds is in it, and returning it to the device
    (empty_cache) moves bytes from reserved to free without changing what the process can have."""
    from gputui.probes import cuda

    device = torch.device("cuda", torch.cuda.current_device())
    held = torch.empty(GiB, dtype=torch.uint8, device=device)
    probe = CudaProbe(device)
    before = probe.capacity()
    free, total = torch.cuda.mem_get_info(device)
    assert before == free + torch.cuda.memory_reserved(device) < total
    del held
    torch.cuda.empty_cache()
    monkeypatch.setattr(cuda, "FREE_MAX_AGE", -1.0)  # read the device again
    assert abs(probe.capacity() - before) <= 64 * MiB  # the driver's granularity, not the gigabyte


def _fraction(device):
    return torch.cuda.get_per_process_memory_fraction(device)


def test_the_cap_is_lifted_after_fit():
    """The fraction before fit is back after it: a tensor larger than the limit fits again."""
    device = torch.device("cuda", torch.cuda.current_device())
    before = _fraction(device)
    model = nn.Linear(64, 64)
    limit = torch.cuda.memory_reserved(device) + 512 * MiB
    seen = []

    def step(model, x):
        seen.append(_fraction(device))
        return model(x).pow(2).mean()

    data = [torch.randn(32, 64) for _ in range(3)]
    gputui.fit(model, data, step, torch.optim.SGD(model.parameters(), lr=0.1), device=device, gpu_memory_limit=limit)
    assert seen and all(f < before for f in seen) and _fraction(device) == before
    big = torch.empty(limit + 256 * MiB, dtype=torch.uint8, device=device)  # past the cap fit had set
    del big


def test_a_real_oom_under_the_cap_after_the_cache_is_emptied(hub):
    """A gigabyte cached before fit would be reused past the cap (the allocator checks it only for a new
    segment): fit empties the cache, so a step needing more than the limit meets a real OOM and recovers."""
    device = torch.device("cuda", torch.cuda.current_device())
    cached = torch.empty(GiB, dtype=torch.uint8, device=device)
    del cached  # reserved, free: reusable without asking the device
    model = nn.Linear(64, 64).to(device)
    limit = torch.cuda.memory_allocated(device) + 384 * MiB

    def step(model, x):
        scratch = torch.ones(len(x), 64 * MiB, dtype=torch.uint8, device=device)  # 64 MiB a sample
        return model(x).pow(2).mean() + scratch[:, 0].float().mean() * 0

    data = [torch.randn(8, 64) for _ in range(2)]  # 512 MiB a whole batch: past the limit
    result = gputui.fit(
        model, data, step, torch.optim.SGD(model.parameters(), lr=0.1), device=device, gpu_memory_limit=limit
    )
    assert result.ooms_recovered >= 1 and result.micro_batch < 8 and result.steps == 2
    assert not [e for e in result.events if e.name == "memory_limit"]  # nothing live was over the cap


def test_memory_held_past_the_cap_is_said(hub):
    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.empty_cache()
    limit = torch.cuda.memory_reserved(device) + 256 * MiB
    held = torch.empty(512 * MiB, dtype=torch.uint8, device=device)  # alive: empty_cache cannot return it
    model = nn.Linear(64, 64)
    data = [torch.randn(8, 64) for _ in range(2)]
    result = gputui.fit(
        model,
        data,
        lambda model, x: model(x).pow(2).mean(),
        torch.optim.SGD(model.parameters()),
        device=device,
        gpu_memory_limit=limit,
    )
    (said,) = [e for e in result.events if e.name == "memory_limit"]
    assert said["limit"] == limit and said["reserved"] >= limit
    del held


def load_snapshot(path):
    """A snapshot pickle as pytorch.org/memory_viz reads it: torch.cuda.memory._snapshot()'s dict."""
    import pickle

    with open(path, "rb") as f:
        snap = pickle.load(f)
    assert set(snap) >= {"segments", "device_traces"}, sorted(snap)
    return snap


def test_memory_history_python_stacks_bounded_and_stopped_after_fit(tmp_path, hub):
    """History on from the start (Python frames only, at most MAX_ENTRIES events), a snapshot asked for
    after step 2 holds it, the dump is timed, and the recording is off once fit returns."""
    from helpers import RequestAt

    from gputui.probes import snapshot

    model = ConvNet(channels=32)
    hub.add_sink(RequestAt(hub, 2, "snapshot"))
    gputui.fit(
        model,
        conv_batches(4, 16),
        conv_step,
        torch.optim.SGD(model.parameters(), lr=0.01),
        device="cuda",
        snapshot_dir=tmp_path,
        memory_history=True,
    )
    assert not torch._C._cuda_isHistoryEnabled(), "history left on after fit"
    (saved,) = [e for e in hub.events() if e.name == "snapshot_saved"]
    assert saved["history"] and saved["seconds"] > 0
    traces = load_snapshot(saved["path"])["device_traces"][torch.cuda.current_device()]
    assert 0 < len(traces) <= snapshot.MAX_ENTRIES
    files = {frame["filename"] for trace in traces for frame in trace["frames"]}
    assert files and not any(f.endswith((".cpp", ".h", ".cu", ".cuh", ".so")) for f in files), sorted(files)[:20]


def test_the_snapshot_at_a_real_oom_shows_the_oom(tmp_path, hub):
    batches = [(b[0].repeat(1, 1, 40, 40), b[1]) for b in conv_batches(2, 64)]
    model = ConvNet(channels=64, blocks=6)
    limit = torch.cuda.memory_allocated() + 600 * MiB
    result = gputui.fit(
        model,
        batches,
        conv_step,
        torch.optim.SGD(model.parameters(), lr=0.01),
        device="cuda",
        gpu_memory_limit=limit,
        memory_history=True,
        snapshot_dir=tmp_path,
    )
    assert result.ooms_recovered >= 1
    at_oom = [e for e in hub.events() if e.name == "snapshot_saved" and e["reason"] == "oom"]
    assert at_oom and at_oom[0]["seconds"] > 0
    traces = load_snapshot(at_oom[0]["path"])["device_traces"][torch.cuda.current_device()]
    assert any(t["action"] == "oom" for t in traces)
    assert not torch._C._cuda_isHistoryEnabled()


OWN_LOOP_OOM = """
import torch
from torch import nn
model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 10))
opt = torch.optim.AdamW(model.parameters())  # made on the CPU, as many scripts do
model.cuda()
for step in range(5):
    x = torch.randn(64, 256, device="cuda")
    if step == 3:
        x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")  # past the 1 GiB cap
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


def test_memory_history_and_snapshot_dir_from_the_command_line_on_an_own_loop(tmp_path):
    """`gputui run --memory-history --snapshot-dir`: the own loop's optimizer was made before .cuda(), the
    run follows its parameters to the GPU (the cap applies there), and its OOM leaves a snapshot."""
    import json
    import subprocess
    import sys

    (tmp_path / "train.py").write_text(OWN_LOOP_OOM)
    done = subprocess.run(
        [sys.executable, "-m", "gputui", "run", "--headless", "--memory-history", "--snapshot-dir", "snaps"]
        + ["--gpu-memory-limit", "1GiB", "--metrics", "m.jsonl", "train.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "GPUTUI_NO_SOCKET": "1"},
    )
    assert done.returncode == 1 and "out of memory" in done.stderr, done.stderr
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    start = next(r for r in records if r["kind"] == "start")
    assert start["device"].startswith("cuda") and start["mode"] == "observe"
    (saved,) = [r for r in records if r.get("name") == "snapshot_saved"]
    assert saved["reason"] == "oom" and saved["path"].startswith(str(tmp_path / "snaps"))
    traces = load_snapshot(saved["path"])["device_traces"]
    assert any(t["action"] == "oom" for device in traces for t in device)


ALLOCATOR_SCRIPT = """
import torch
from gputui.telemetry import hub as hubs
hubs.current().controls.request("snapshot")  # `s`, at the first step boundary
model = torch.nn.Linear(512, 512).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(4):
    model(torch.randn(64, 512, device="cuda")).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
"""


@pytest.mark.parametrize(
    "conf, unreadable",
    [
        ("backend:cudaMallocAsync", dict.fromkeys(("fragmented", "alloc_retries", "ooms"), "cudaMallocAsync")),
        ("expandable_segments:True", {"fragmented": "expandable segments"}),
    ],
)
def test_allocator_settings_say_what_cannot_be_read(tmp_path, conf, unreadable):
    """cudaMallocAsync: `s` and --memory-history are refused with a line and the run goes on (torch raises
    for both there); its uncounted figures, like fragmentation under expandable segments, read null."""
    import json
    import subprocess
    import sys

    (tmp_path / "train.py").write_text(ALLOCATOR_SCRIPT)
    done = subprocess.run(
        [sys.executable, "-m", "gputui", "run", "--headless", "--memory-history", "--metrics", "m.jsonl", "train.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "GPUTUI_NO_SOCKET": "1", "PYTORCH_CUDA_ALLOC_CONF": conf},
    )
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    start = next(r for r in records if r["kind"] == "start")
    assert start["unreadable"] == unreadable
    steps = [r for r in records if r["kind"] == "step"]
    assert len(steps) == 4 and all(s["memory"]["fragmented"] is None for s in steps)
    refused = {r["action"] for r in records if r.get("name") == "control_refused"}
    saved = [r for r in records if r.get("name") == "snapshot_saved"]
    if conf.startswith("backend"):
        assert refused == {"memory_history", "snapshot"} and not saved
    else:
        assert not refused and len(saved) == 1


def test_an_own_loop_adds_no_sync_a_step(hub):
    """Every step after the first runs under sync debug mode "error" with the observer watching: the loss
    it reads goes through pinned memory behind an event (engine/deferred.py), as fit's does; the optimizer
    is made before .cuda(), and the readings follow the parameters to the GPU."""
    from gputui.engine.observe import Observer

    torch.manual_seed(0)
    model = ConvNet(channels=32)
    batches = [(x.cuda(), y.cuda()) for x, y in conv_batches(8, 16)]
    observer = Observer(hub)
    computed = []
    try:
        with observer.installed():
            opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
            model.cuda()
            for i, batch in enumerate(batches):
                torch.cuda.set_sync_debug_mode("error" if i else "default")
                loss = conv_step(model, batch)
                computed.append(loss.detach())
                opt.zero_grad()
                loss.backward()
                opt.step()
            torch.cuda.set_sync_debug_mode("default")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    observer.finish(None)
    losses = [t.item() for t in computed]
    assert hub.info is not None and hub.info.device.startswith("cuda")
    assert len(hub.samples()) == 8 and all(s.memory.device.startswith("cuda") for s in hub.samples())
    assert {s.loss for s in hub.samples()} <= {None, *losses}
    assert hub.summary is not None and hub.summary.loss == losses[-1]


# -- the planner's count, estimates, cuDNN, fp16's scaler (issue 28: 3, 7, 10, 11) ---------------------------


def gpt_case(batch=32):
    """The demo GPT at a size whose step is about a GiB: the allocator's workspaces stay a few percent of it."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "demos"))
    import gpt

    device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    model = gpt.GPT(8192, 512, 4, 8, 256).to(device)
    tokens = torch.randint(8192, (batch, 257), device=device)
    return model, {"input": tokens[:, :-1], "target": tokens[:, 1:]}, gpt.step, device


def test_the_allocator_hands_out_the_blocks_the_planner_counts():
    """plan/blocks.py's reading of CUDACachingAllocator.cpp, against the allocator itself: each request, made
    in a private pool of its own (so from a new segment, whatever this process has cached), moves
    memory_allocated by the block predicted."""
    from gputui.plan.blocks import rounding

    device = torch.device("cuda", torch.cuda.current_device())
    blocks = rounding(device)
    for asked in (1, 513, MiB, MiB + 1, 10 * MiB + 1, 11 * MiB - 512, 11 * MiB, 11 * MiB + 512 * 1024, 101 * MiB + 1):
        pool = torch.cuda.MemPool()
        with torch.cuda.use_mem_pool(pool):
            before = torch.cuda.memory_allocated(device)
            t = torch.empty(asked, dtype=torch.uint8, device=device)
            assert torch.cuda.memory_allocated(device) - before == blocks(asked), asked
        del t, pool
    torch.cuda.empty_cache()


@pytest.mark.parametrize("amp", ["off", "bf16"])
def test_a_transformer_step_is_predicted_within_5_percent_of_max_memory_allocated(amp):
    """The demo GPT's step traced before calibration, against the allocator's peak for the same step. What
    the trace cannot see: cuBLAS/cuBLASLt workspaces (allocated through the caching allocator, held from the
    first matmul on), hence 5 % + 64 MiB."""
    from gputui.plan import predict

    model, batch, step, device = gpt_case()
    opt = torch.optim.AdamW(model.parameters())
    gputui.fit(model, [batch], step, opt, device=device)  # the optimizer's state exists
    predicted = predict(model, opt, batch, step, micro_batch=16, amp=amp)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(device)
    gputui.fit(model, [batch], step, opt, device=device, micro_batch=16, amp=amp)
    measured = torch.cuda.max_memory_allocated(device)
    assert predicted.exact
    assert abs(predicted.peak - measured) <= 0.05 * measured + 64 * MiB, (predicted.peak, measured)


def test_an_estimate_on_cuda_keeps_the_training_state_and_is_within_20_percent(hub):
    """A step that cannot be traced (a boolean mask) is estimated from the measured one: CUDA's reading has
    totals only, so the parameters, gradients and AdamW's state are counted from their storages and kept;
    halving the micro-batch halves only the rest (scaling the whole peak would be off by about a third)."""
    from helpers import RequestAt

    from gputui.plan.blocks import rounding

    model, batch, step, device = gpt_case()

    def masked(model, batch):
        keep = batch["target"][:, 0] >= 0  # every sequence, but the trace cannot know how many
        return step(model, {k: v[keep] for k, v in batch.items()})

    opt = torch.optim.AdamW(model.parameters())
    hub.add_sink(RequestAt(hub, 2, "plan"))
    gputui.fit(model, [batch] * 4, masked, opt, device=device, micro_batch=16)
    plan = [e for e in hub.events() if e.name == "plan"][-1]
    halve = next(o for o in plan["options"] if o["remedy"] == "halve")
    blocks = rounding(device)
    params = sum(blocks(p.untyped_storage().nbytes()) for p in dict.fromkeys(model.parameters()))
    assert not halve["exact"] and halve["breakdown"]["parameters"] == params
    torch.cuda.reset_peak_memory_stats(device)
    gputui.fit(model, [batch], masked, opt, device=device, micro_batch=halve["micro_batch"])
    measured = torch.cuda.max_memory_allocated(device)
    assert abs(halve["predicted"] - measured) <= 0.2 * measured, (halve["predicted"], measured)


def test_cudnn_not_supported_is_an_oom_only_while_memory_is_near_full():
    """The readings behind the cuDNN rule, on a device: an idle process is far from full; one holding 95 % of
    what it can have (what it reserves and what is free, or less under a cap) is near it."""
    from gputui.engine.oom import cuda_nearly_full

    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.empty_cache()
    assert not cuda_nearly_full()
    reserved = torch.cuda.memory_reserved(device)
    free, total = torch.cuda.mem_get_info(device)
    can_have = min(reserved + free, int(torch.cuda.get_per_process_memory_fraction(device) * total))
    hog = torch.empty(int(0.95 * can_have) - reserved, dtype=torch.uint8, device=device)
    assert cuda_nearly_full()
    del hog
    torch.cuda.empty_cache()
    assert not cuda_nearly_full()


@pytest.mark.parametrize("fused", [True, False])
def test_fp16_with_a_fused_optimizer_steps_without_waiting_for_the_gpu(hub, fused):
    """GradScaler hands a fused optimizer the scale and the overflow flag as tensors (its
    _step_supports_amp_scaling path); any other it steps through _maybe_opt_step, whose .item() waits, which
    sync debug mode "error" turns into a RuntimeError. Without fused=True, the run says so once (fused_hint)."""
    torch.manual_seed(0)
    model = ConvNet(channels=32).cuda()
    batches = [(x.cuda(), y.cuda()) for x, y in conv_batches(6, 16)]

    def strict():
        for i, batch in enumerate(batches):
            torch.cuda.set_sync_debug_mode("error" if i else "default")  # the first step initialises lazily
            yield batch
        torch.cuda.set_sync_debug_mode("default")

    opt = torch.optim.AdamW(model.parameters(), fused=fused)
    try:
        if fused:
            result = gputui.fit(model, strict(), conv_step, opt, device="cuda", amp="fp16")
            assert result.steps == 6
        else:
            with pytest.raises(RuntimeError, match="synchroniz"):
                gputui.fit(model, strict(), conv_step, opt, device="cuda", amp="fp16")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    hints = [e for e in hub.events() if e.name == "fused_hint"]
    assert len(hints) == (0 if fused else 1)
