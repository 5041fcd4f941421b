"""On a real GPU: the readings agree with the allocator, and the CUDA-only paths work end to end.

Run through the device tool when a GPU is lent: `pytest -m gpu tests/gpu`.
"""

import os

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
    with NvmlPoller(interval=0.25) as poller:
        import time

        deadline = time.monotonic() + 5
        while poller.latest() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        from gputui.probes.cuda import NvmlView

        used = NvmlView(poller, index, os.getpid()).used()
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
