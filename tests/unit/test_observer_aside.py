"""Under `gputui run` a script's fit runs without the observer's saved-tensor hooks (a Python call for
each tensor autograd saves: 5 % of a small step), and its own loop after fit is watched again."""

import textwrap

from gputui.launch import run_script
from gputui.telemetry.setup import opened

SCRIPT = """
import json, sys, torch, gputui
from torch import nn
def observed():
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(True)
    return hooks is not None and "Observer" in getattr(hooks[0], "__qualname__", "")

seen = {"before": observed(), "in fit": []}
model = nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
data = [(torch.randn(8, 4), torch.randint(2, (8,))) for _ in range(3)]

def step(model, batch):
    seen["in fit"].append(observed())
    return nn.functional.cross_entropy(model(batch[0]), batch[1])

gputui.fit(model, data, step, opt)
seen["after"] = observed()
try:
    gputui.fit(model, data, lambda m, b: 1 / 0, opt)
except ZeroDivisionError:
    pass
seen["after a failed fit"] = observed()
json.dump(seen, open(sys.argv[1], "w"))
"""


def test_fit_runs_without_the_observers_hooks_and_they_come_back_after(tmp_path):
    import json

    script, out = tmp_path / "train.py", tmp_path / "seen.json"
    script.write_text(textwrap.dedent(SCRIPT))
    with opened(attachable=False) as hub:
        assert run_script(str(script), [str(out)], observe=hub) == 0
    seen = json.loads(out.read_text())
    assert seen == {"before": True, "in fit": [False, False, False], "after": True, "after a failed fit": True}


def test_a_loss_fit_scales_is_not_kept_for_the_observer():
    """fit's GradScaler scales a loss each micro-batch under fp16; the observer reads no backward() while
    fit trains, so a loss kept for it would stay for the whole run, one device scalar a micro-batch."""
    from types import SimpleNamespace

    import torch

    from gputui.engine.patches import patches

    observer = SimpleNamespace(fitting=True, unscaled={})
    scale = next(patch for owner, name, patch in patches(observer) if name == "scale")
    scaler, loss = torch.amp.GradScaler("cpu"), torch.tensor(2.0, requires_grad=True)
    scaled = scale(scaler, loss)
    assert observer.unscaled == {} and scaled.item() == 2.0 * scaler.get_scale()
    observer.fitting = False  # the script's own loop: its loss, unscaled, for backward() to find
    scaled = scale(scaler, loss)
    assert list(observer.unscaled) == [id(scaled)] and observer.unscaled[id(scaled)].item() == 2.0
