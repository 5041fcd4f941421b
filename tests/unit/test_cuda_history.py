"""CUDA memory history, snapshots and the allocator's blind spots, driven on this CPU through stand-ins
for torch.cuda (helpers.HistoryStandIn, helpers.stand_in_gpu): history recorded with Python stacks
and a bound, stopped when the run that started it ends (never a script's own), each dump timed; under
`backend:cudaMallocAsync` history and snapshots refused with a reason (the run goes on) and the
figures that backend does not count read None, as fragmentation does under expandable segments.
What only a device shows is in tests/gpu/test_cuda.py."""

import pytest
import torch
from helpers import GPU_STATS, ConvNet, HistoryStandIn, conv_batches, conv_step, stand_in_gpu
from torch import nn

import gputui
from gputui.engine.session import RunSession
from gputui.probes import allocator, snapshot
from gputui.probes.cuda import CudaProbe
from gputui.telemetry.controls import Control
from gputui.telemetry.hub import Hub, Overrides

CUDA0 = torch.device("cuda", 0)


@pytest.fixture(autouse=True)
def no_alloc_conf(monkeypatch):
    """The settings this process was started with are not the test's."""
    for name in allocator.ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch._C, "_accelerator_getAllocatorSettings", lambda: "", raising=False)


def fit_with_history(tmp_path, monkeypatch, channels=8, size=8, **kwargs):
    monkeypatch.setattr(snapshot, "unavailable", lambda device: None)  # this CPU run records as CUDA would
    model = ConvNet(channels=channels)
    return gputui.fit(
        model,
        conv_batches(2, size),
        conv_step,
        torch.optim.SGD(model.parameters(), lr=0.01),
        snapshot_dir=tmp_path,
        **kwargs,
    )


def test_history_records_python_stacks_within_a_bound_and_stops_with_the_run(tmp_path, monkeypatch, hub):
    torch_calls = HistoryStandIn(monkeypatch)
    hub.controls.request("snapshot")
    fit_with_history(tmp_path, monkeypatch, memory_history=True)
    assert torch_calls.calls == [
        ("all", {"max_entries": snapshot.MAX_ENTRIES, "stacks": "python"}),
        (None, {}),  # stopped when fit returned: not left on for the rest of the process
    ]
    saved = [e for e in hub.events() if e.name == "snapshot_saved"]
    assert len(saved) == 1 and saved[0]["history"] and isinstance(saved[0]["seconds"], float)


def test_the_first_snapshot_starts_history_until_the_run_ends(tmp_path, monkeypatch, hub):
    torch_calls = HistoryStandIn(monkeypatch)
    hub.controls.request("snapshot")
    fit_with_history(tmp_path, monkeypatch)
    assert [enabled for enabled, _ in torch_calls.calls] == ["all", None]
    fit_with_history(tmp_path, monkeypatch)  # a second run in the process records nothing it was not asked to
    assert [enabled for enabled, _ in torch_calls.calls] == ["all", None]


def test_a_scripts_own_recording_is_neither_changed_nor_stopped(tmp_path, monkeypatch, hub):
    torch_calls = HistoryStandIn(monkeypatch)
    torch_calls.on = True  # the script called _record_memory_history itself, with its own settings
    hub.controls.request("snapshot")
    fit_with_history(tmp_path, monkeypatch, memory_history=True)
    assert torch_calls.calls == [] and torch_calls.on
    assert [e["history"] for e in hub.events() if e.name == "snapshot_saved"] == [True]


def test_the_snapshot_at_an_oom_is_timed(tmp_path, monkeypatch, hub):
    HistoryStandIn(monkeypatch)
    result = fit_with_history(tmp_path, monkeypatch, channels=16, size=16, memory_history=True, memory_budget="200KiB")
    assert result.ooms_recovered >= 1
    at_oom = [e for e in hub.events() if e.name == "snapshot_saved" and e["reason"] == "oom"]
    assert at_oom and all(isinstance(e["seconds"], float) and e["seconds"] >= 0 for e in at_oom)


def session_on_stand_in_gpu(hub, monkeypatch):
    """A run on cuda:0 as fit and an own loop make it, its figures read from the stand-in allocator."""
    stand_in_gpu(monkeypatch)
    model = nn.Linear(8, 2)
    session = RunSession(hub, CUDA0, tracked=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    session.start(mode="observe", model="own loop", refused={})
    return session


def test_cuda_malloc_async_refuses_history_and_snapshots_with_a_reason_and_the_run_goes_on(tmp_path, monkeypatch):
    torch_calls = HistoryStandIn(monkeypatch, backend="cudaMallocAsync")  # raises as torch does
    hub = Hub(Overrides(memory_history=True, snapshot_dir=str(tmp_path)))
    session = session_on_stand_in_gpu(hub, monkeypatch)
    for action in ("snapshot", "memory_summary"):  # `s`, and torch's own report, which works there
        session.apply(Control(action))
    refused = {e["action"]: e["reason"] for e in hub.events() if e.name == "control_refused"}
    assert set(refused) == {"memory_history", "snapshot"}
    assert all("backend:cudaMallocAsync" in reason for reason in refused.values())
    assert hub.info is not None and hub.info.refused["snapshot"] == refused["snapshot"]
    assert [e.name for e in hub.events()][-1] == "memory_summary"
    assert torch_calls.calls == [] and not list(tmp_path.iterdir())


def test_cuda_malloc_async_figures_it_does_not_count_read_none_not_zero(monkeypatch, hub):
    HistoryStandIn(monkeypatch, backend="cudaMallocAsync")
    session = session_on_stand_in_gpu(hub, monkeypatch)
    assert hub.info is not None and hub.info.unreadable == dict.fromkeys(
        ("fragmented", "alloc_retries", "ooms"), "cudaMallocAsync"
    )
    m = session.probe.read()
    assert (m.fragmented, m.alloc_retries, m.ooms) == (None, None, None)
    assert m.allocated == GPU_STATS["allocated_bytes.all.current"]  # what it counts is read as before


@pytest.mark.parametrize("variable", ["PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"])
def test_expandable_segments_leave_fragmentation_unread(monkeypatch, variable):
    stand_in_gpu(monkeypatch)
    monkeypatch.setenv(variable, "max_split_size_mb:128, expandable_segments:True")
    probe = CudaProbe(CUDA0)
    assert probe.unreadable == {"fragmented": "expandable segments"}
    m = probe.read()
    assert m.fragmented is None and m.alloc_retries == 0  # retries are still counted


def test_the_allocator_settings_torch_parsed_win_over_the_environment(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "backend:cudaMallocAsync")
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:False")  # torch reads this one alone
    assert allocator.settings() == {"expandable_segments": "False"}
    monkeypatch.setattr(torch._C, "_accelerator_getAllocatorSettings", lambda: "expandable_segments:True")
    assert allocator.unreadable() == {"fragmented": "expandable segments"}  # set since, at run time
    assert allocator.parse("roundup_power2_divisions:[256:1,>:4], backend : native") == {
        "roundup_power2_divisions": "[256:1,>:4]",
        "backend": "native",
    }
