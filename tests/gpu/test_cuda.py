"""On a real GPU: the readings agree with the allocator, and the CUDA-only paths work end to end.

Run through the device tool when a GPU is lent: `pytest -m gpu tests/gpu`.
"""

import os
import threading

import pytest
import torch
from helpers import ConvNet, assert_same_weights, conv_batches, conv_step, plain_loop, twins

import gputui
from gputui.probes.cuda import CudaProbe
from gputui.probes.nvml import NvmlPoller, cuda_to_nvml_index

pytestmark = pytest.mark.gpu
MiB = 2**20


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
    assert m.cached_free >= 64 * MiB and m.capacity == torch.cuda.get_device_properties(device).total_memory
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
    """Every step after the first runs under sync debug mode "error": the loss reaches the host through
    pinned memory behind an event (engine/deferred.py), and nothing else in the step waits for the GPU.
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
            model, strict(), step, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), device="cuda"
        )
    finally:
        torch.cuda.set_sync_debug_mode("default")
    losses = [t.item() for t in computed]
    assert result.steps == 8 and result.loss == losses[-1]
    assert {s.loss for s in hub.samples()} <= {None, *losses}  # a step late or more, never made up
