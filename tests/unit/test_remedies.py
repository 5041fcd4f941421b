import pytest
import torch
from helpers import ConvNet, TokenModel, conv_batches, conv_step, twins
from torch import nn

import gputui
from gputui.engine.remedies import Checkpointing, Precision, find_blocks


def test_find_blocks_prefers_the_heaviest_repeated_container():
    model = nn.Sequential(
        nn.Linear(4, 4),
        nn.ReLU(),
        nn.ModuleDict(
            {
                "small": nn.ModuleList(nn.Linear(2, 2) for _ in range(5)),
                "big": nn.ModuleList(nn.Linear(32, 32) for _ in range(3)),
                "mixed": nn.ModuleList([nn.Linear(64, 64), nn.ReLU()]),
            }
        ),
    )
    blocks = find_blocks(model)
    assert len(blocks) == 3 and all(b.in_features == 32 for b in blocks)
    assert find_blocks(nn.Sequential(nn.Linear(2, 2), nn.ReLU())) == []
    assert len(find_blocks(TokenModel(layers=4))) == 4


def test_checkpointing_same_gradients_less_saved_memory():
    x = torch.randn(4, 3, 6, 6)
    a, b = twins(lambda: ConvNet(blocks=4))
    saved = {}
    for name, model, on in (("plain", a, False), ("ckpt", b, True)):
        switch = Checkpointing(model)
        switch.set(on)
        count = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t, count=count: count.append(t.numel()) or t, lambda t: t):
            model(x).sum().backward()
        saved[name] = sum(count)
        switch.remove()
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-5)
    assert saved["ckpt"] < saved["plain"] / 2


def test_checkpointing_is_a_flag_and_remove_restores_the_module():
    model = ConvNet()
    keys = list(model.state_dict())
    switch = Checkpointing(model)
    switch.set(True)
    wrappers = [vars(block)["forward"] for block in switch.blocks]
    switch.set(False)
    switch.set(True)  # toggling reinstalls nothing: the same wrappers read the flag
    assert [vars(block)["forward"] for block in switch.blocks] == wrappers
    assert list(model.state_dict()) == keys
    switch.remove()
    assert not any("forward" in vars(m) for m in model.modules())


class CountedLinear(nn.Linear):
    """Counts its own forward runs: a checkpointed block runs it again in backward (recomputation)."""

    runs = 0

    def forward(self, x):
        self.runs += 1
        return super().forward(x)


def test_checkpoint_modules_named_by_the_script():
    model = nn.Sequential(CountedLinear(4, 8), nn.ReLU(), CountedLinear(8, 1))
    switch = Checkpointing(model, [model[0], model[2]])
    assert switch.unavailable() is None and switch.how == "2 x CountedLinear"

    def runs_in_a_step():
        before = [model[0].runs, model[2].runs]
        model(torch.randn(2, 4, requires_grad=True)).sum().backward()
        return [model[0].runs - before[0], model[2].runs - before[1]]

    assert runs_in_a_step() == [1, 1]
    switch.set(True)
    assert runs_in_a_step() == [2, 2], "checkpointed: each block's forward runs again in backward"
    switch.set(False)
    assert runs_in_a_step() == [1, 1], "switched off: no recomputation"
    switch.remove()
    assert runs_in_a_step() == [1, 1]


def test_hugging_face_models_use_their_own_switch():
    calls = []

    class HFLike(nn.Module):
        supports_gradient_checkpointing = True

        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(3, 3) for _ in range(2))

        def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
            calls.append(("enable", gradient_checkpointing_kwargs))

        def gradient_checkpointing_disable(self):
            calls.append(("disable", None))

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    model = HFLike()
    switch = Checkpointing(model)
    assert switch.how == "hugging face" and switch.blocks == []
    switch.set(True)
    switch.remove()
    assert calls == [("enable", {"use_reentrant": False}), ("disable", None)]
    assert "forward" not in vars(model.layers[0])


def test_precision_modes():
    cpu = torch.device("cpu")
    p = Precision(cpu, "fp16")
    assert p.scaler is not None and p.scaler.is_enabled()
    p.set("bf16")
    assert p.scaler is None
    with p.autocast():
        assert torch.nn.Linear(2, 2)(torch.randn(1, 2)).dtype == torch.bfloat16
    p.set("off")
    with p.autocast():
        assert torch.nn.Linear(2, 2)(torch.randn(1, 2)).dtype == torch.float32
    assert Precision(cpu, "auto").mode == "off"
    with pytest.raises(ValueError, match="unknown AMP mode 'fp8'"):
        Precision(cpu, "fp8")


@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_fit_trains_under_amp(amp):
    torch.manual_seed(0)
    model = ConvNet()
    batches = conv_batches(8, 8) * 3
    first = conv_step(model, batches[0]).item()
    result = gputui.fit(model, batches, conv_step, torch.optim.Adam(model.parameters(), lr=1e-2), amp=amp)
    assert result.amp == amp and result.loss < first
