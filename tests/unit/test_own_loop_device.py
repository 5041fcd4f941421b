"""A script's own loop on CUDA, driven on this CPU through stand-ins: its losses are read as fit reads
its own (engine/deferred.py: no wait for the device a step), and the run follows the parameters to
the device they move to after the optimizer was made. What only a GPU shows (no sync a step under
`torch.cuda.set_sync_debug_mode("error")`) is in tests/gpu/test_cuda.py."""

import torch
from helpers import stand_in_gpu
from torch import nn
from torch.nn import functional as F

from gputui.engine import deferred, observe
from gputui.telemetry.hub import Hub, Overrides


class Late:
    """A loss copy that arrives one put after it started, as a GPU's lags the CPU; reading it is no .item()."""

    puts = 0

    def start(self, loss: torch.Tensor) -> None:
        Late.puts += 1
        self.at, self.loss, self.waited = Late.puts, loss.detach().clone(), False

    def done(self) -> bool:
        return self.waited or Late.puts > self.at

    def wait(self) -> None:
        self.waited = True

    def value(self) -> float:
        return float(self.loss)  # the host copy's value, once it arrived: no device to wait for


def own_loop(model, opt, steps, *, before_step=lambda i: None):
    """The loop a script writes, none of it reading a loss: every .item() is the observer's."""
    torch.manual_seed(0)
    losses = []
    for i in range(steps):
        before_step(i)
        x, y = torch.randn(16, 8), torch.randint(2, (16,))
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def test_an_own_loops_losses_are_read_without_waiting_for_the_device(hub, monkeypatch):
    monkeypatch.setattr(deferred.DeferredLoss, "for_device", classmethod(lambda cls, device: cls(Late)))
    items = []
    real_item = torch.Tensor.item
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    observer = observe.Observer(hub)
    with observer.installed():
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with monkeypatch.context() as counting:
            counting.setattr(torch.Tensor, "item", lambda t: items.append(t.shape) or real_item(t))
            computed = own_loop(model, opt, 5)
    assert items == [], "the observer waited for the device during the loop"
    observer.finish(None)
    assert [s.loss for s in hub.samples()] == [None, *computed[:-1]]  # a step late, as fit's on a GPU
    assert hub.summary is not None and hub.summary.loss == computed[-1]  # the last one waited for, at the end


def test_an_optimizer_made_before_the_model_moves_is_watched_where_the_parameters_went(monkeypatch):
    """`opt = SGD(model.parameters()); model.cuda()`: the same parameters move, the run follows them,
    and --gpu-memory-limit applies there (it was refused as a CPU run)."""
    stand_in_gpu(monkeypatch)
    moved = []
    monkeypatch.setattr(
        observe, "parameters_device", lambda opt: torch.device("cuda", 0) if moved else torch.device("cpu")
    )
    hub = Hub(Overrides(gpu_memory_limit=2**30))
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    observer = observe.Observer(hub)
    with observer.installed():
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        moved.append(True)  # model.cuda()
        own_loop(model, opt, 3)
    observer.finish(None)
    assert hub.info is not None and (hub.info.device, hub.info.device_name) == ("cuda:0", "stand-in GPU")
    memory = [s.memory for s in hub.samples()]
    assert {(m.device, m.capacity, m.params) for m in memory} == {("cuda:0", 2**30, None)}  # no CPU tracker
    assert hub.summary is not None and hub.summary.error is None and hub.summary.steps == 3


def test_parameters_that_move_mid_run_take_the_readings_with_them(hub, monkeypatch):
    stand_in_gpu(monkeypatch)
    moved = []
    monkeypatch.setattr(
        observe, "parameters_device", lambda opt: torch.device("cuda", 0) if moved else torch.device("cpu")
    )
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    observer = observe.Observer(hub)
    with observer.installed():
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        own_loop(model, opt, 4, before_step=lambda i: i == 2 and moved.append(True))
    observer.finish(None)
    assert [s.memory.device for s in hub.samples()] == ["cpu", "cpu", "cuda:0", "cuda:0"]
    assert hub.samples()[-1].memory.reserved == 8 << 20  # the stand-in allocator's, read by CudaProbe
