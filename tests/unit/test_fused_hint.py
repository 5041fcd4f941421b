"""fp16's GradScaler waits for the GPU once a step unless the optimizer is fused: said once, with the fix."""

import pytest
import torch
from helpers import ConvNet, conv_batches, conv_step
from torch import nn

import gputui
from gputui.step import precision
from gputui.step.precision import unfused_fix

CUDA = torch.device("cuda", 0)  # only its type is read: no GPU needed


def params():
    return nn.Linear(4, 4).parameters()


def test_the_fix_is_named_for_an_optimizer_made_without_its_fused_mode():
    assert unfused_fix(torch.optim.AdamW(params(), fused=False), CUDA) == "torch.optim.AdamW(..., fused=True)"
    assert unfused_fix(torch.optim.SGD(params(), lr=0.1), CUDA) == "torch.optim.SGD(..., fused=True)"
    assert unfused_fix(torch.optim.AdamW(params(), fused=True), CUDA) is None  # its step takes the scaler's tensors
    assert unfused_fix(torch.optim.RMSprop(params()), CUDA) is None  # no fused mode to offer
    assert unfused_fix(torch.optim.AdamW(params()), torch.device("cpu")) is None  # .item() waits for nothing there


@pytest.mark.parametrize(
    ("amp", "fused", "said"), [("fp16", False, True), ("fp16", True, False), ("bf16", False, False)]
)
def test_fp16_says_once_that_its_scaler_waits_for_the_gpu(monkeypatch, amp, fused, said):
    monkeypatch.setattr(precision, "WAITING_DEVICES", frozenset({"cpu"}))  # the CPU stands in for a GPU
    model = ConvNet()
    opt = torch.optim.AdamW(model.parameters(), fused=fused)
    result = gputui.fit(model, conv_batches(3, 4), conv_step, opt, amp=amp)
    hints = [e for e in result.events if e.name == "fused_hint"]
    assert result.steps == 3
    if said:
        assert len(hints) == 1  # once a run, not once a step
        assert hints[0]["optimizer"] == "AdamW" and hints[0]["fix"] == "torch.optim.AdamW(..., fused=True)"
    else:
        assert hints == []
    assert opt.defaults["fused"] is fused  # the script's optimizer, never rebuilt
