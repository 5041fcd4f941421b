"""gputui.plan.predict against what fit then measures, and the real run left as it was.

The models are not built for these tests: the demos' MLP and GPT, the conv net with BatchNorm the other
tests train, and a Hugging Face GPT-2 from a small config (nothing downloaded). Each prediction is
compared with the peak fit's CPU tracker counts for the same step (parameters, gradients, optimizer
state, saved activations), for every remedy the planner offers.
"""

from __future__ import annotations

import random
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import ConvNet, assert_same_tensors, conv_step
from torch import nn

import gputui
from gputui import plan, probes
from gputui.probes.cpu import tensor_bytes
from gputui.step.checkpointing import Checkpointing

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "demos"))
import gpt as demo_gpt
import mlp as demo_mlp

TOLERANCE = 0.05
PHASES = ("forward", "backward", "optimizer")


@dataclass(frozen=True)
class Case:
    """A model, one batch of `size` samples and the step that trains it; a fresh instance each make()."""

    name: str
    size: int
    build: Callable[[], tuple[nn.Module, Any, Callable[[nn.Module, Any], torch.Tensor]]]

    def make(self, optimizer: Callable[..., torch.optim.Optimizer] = torch.optim.AdamW):
        torch.manual_seed(0)
        model, batch, step = self.build()
        return model, optimizer(model.parameters()), batch, step


def demo_mlp_case():
    model = demo_mlp.MLP(64, *demo_mlp.SIZES["tiny"], 10)
    return model, (torch.randn(16, 64), torch.randint(10, (16,))), demo_mlp.step


def demo_gpt_case():
    width, layers, heads, seq = demo_gpt.SIZES["tiny"]
    model = demo_gpt.GPT(64, width, layers, heads, seq)
    tokens = torch.randint(64, (8, seq + 1))
    return model, {"input": tokens[:, :-1], "target": tokens[:, 1:]}, demo_gpt.step


def conv_bn_case():
    return ConvNet(batch_norm=True), (torch.randn(8, 3, 6, 6), torch.randint(5, (8,))), conv_step


def gpt2_case():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0
    )
    tokens = torch.randint(64, (8, 16))
    return transformers.GPT2LMHeadModel(config), {"input_ids": tokens, "labels": tokens}, gpt2_step


def gpt2_step(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**batch).loss


CASES = [
    Case("demo MLP", 16, demo_mlp_case),
    Case("demo GPT", 8, demo_gpt_case),
    Case("conv net with BatchNorm", 8, conv_bn_case),
    Case("HF GPT2LMHeadModel", 8, gpt2_case),
]
BY_NAME = {case.name: case for case in CASES}


def remedies(size: int) -> dict[str, dict[str, Any]]:
    """fit's settings for each remedy of a batch of `size` (BatchNorm's micro-batches stay >= 2)."""
    return {
        "as started": {},
        "micro-batch halved": {"micro_batch": size // 2},
        "AMP bf16": {"amp": "bf16"},
        "checkpointing": {"checkpointing": True},
        "quarter, bf16 and checkpointing": {"micro_batch": size // 4, "amp": "bf16", "checkpointing": True},
    }


def measured_peaks(hub, model, optimizer, batch, step, steps: int = 1, **settings) -> list[int]:
    """Each step's peak as fit's CPU tracker counts it. The budget far above it only makes every step
    counted, each gradient as it arrives (as under a real budget)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(probes, "STEP_READ_S", 0.0)  # a reading after every step, not a few a second
        gputui.fit(model, [batch] * steps, step, optimizer, memory_budget="64GiB", **settings)
    samples = hub.samples()[-steps:]
    assert [s.step for s in samples] == list(range(samples[0].step, samples[0].step + steps))
    return [s.memory.peak for s in samples]


def error(predicted: int, measured: int) -> float:
    return (predicted - measured) / measured


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_the_predicted_peak_is_the_trackers_for_every_remedy(case, hub):
    model, optimizer, batch, step = case.make()
    measured_peaks(hub, model, optimizer, batch, step)  # the optimizer holds its state, as at every later step
    held = tensor_bytes([*model.parameters(), *model.buffers()])
    errors = {}
    for remedy, settings in remedies(case.size).items():
        p = plan.predict(model, optimizer, batch, step, **settings)
        assert p.exact and p.reason is None, remedy
        assert p.phase in PHASES, remedy
        assert (p.micro_batch, p.amp, p.checkpointing) == (
            settings.get("micro_batch", case.size),
            settings.get("amp", "off"),
            settings.get("checkpointing", False),
        )
        # what was alive at the peak, part by part, is the peak; the model's own tensors counted once
        assert set(p.breakdown) == set(plan.PARTS) and sum(p.breakdown.values()) == p.peak, (remedy, p.breakdown)
        assert p.breakdown["parameters"] == held, remedy
        measured = measured_peaks(hub, model, optimizer, batch, step, **settings)[-1]
        errors[remedy] = (p.tracked_peak, measured, f"{100 * error(p.tracked_peak, measured):+.2f}%")
    assert all(abs(error(predicted, measured)) <= TOLERANCE for predicted, measured, _ in errors.values()), errors


@pytest.mark.parametrize(
    "optimizer",
    [torch.optim.AdamW, lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9)],
    ids=["AdamW", "SGD with momentum"],
)
def test_a_fresh_optimizer_is_predicted_at_its_second_step_which_holds_the_state(optimizer, hub):
    model, optimizer, batch, step = BY_NAME["demo GPT"].make(optimizer)
    predicted = plan.predict(model, optimizer, batch, step, micro_batch=4)
    assert not optimizer.state  # traced on a copy: the real optimizer made no state
    first, second = measured_peaks(hub, model, optimizer, batch, step, steps=2, micro_batch=4)
    assert second > (1 + 2 * TOLERANCE) * first  # what tracing the first step alone would miss
    assert abs(error(predicted.tracked_peak, max(first, second))) <= TOLERANCE, (predicted.tracked_peak, first, second)


def tensors_of(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every tensor of the run by name: parameters, buffers, gradients, optimizer state (`step` too)."""
    names = {p: n for n, p in model.named_parameters()}
    found = {f"parameter {n}": p for n, p in model.named_parameters()}
    found |= {f"buffer {n}": b for n, b in model.named_buffers()}
    found |= {f"gradient {n}": p.grad for n, p in model.named_parameters() if p.grad is not None}
    for p, state in optimizer.state.items():
        found |= {f"optimizer {names[p]} {k}": v for k, v in state.items() if isinstance(v, torch.Tensor)}
    return found


def everything(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What a prediction must leave as it was: each tensor's value and identity (the same object, the same
    memory), the optimizer's other state and groups, the modules' attributes and the RNGs."""
    tensors = tensors_of(model, optimizer)
    return {
        "values": {name: t.detach().clone() for name, t in tensors.items()},
        "objects": {name: (id(t), t.data_ptr(), t.requires_grad) for name, t in tensors.items()},
        "scalars": [{k: v for k, v in s.items() if not isinstance(v, torch.Tensor)} for s in optimizer.state.values()],
        "groups": [
            {k: v if k != "params" else [id(p) for p in v] for k, v in g.items()} for g in optimizer.param_groups
        ],
        "modules": {name: (sorted(vars(m)), m.training) for name, m in model.named_modules()},
        "checkpointing flags": {name: vars(m).get("gradient_checkpointing") for name, m in model.named_modules()},
        "torch rng": torch.get_rng_state(),
        "python random": random.getstate(),
    }


def assert_unchanged(before: dict[str, Any], after: dict[str, Any]) -> None:
    assert_same_tensors(before["values"], after["values"], atol=0, rtol=0)
    assert torch.equal(before["torch rng"], after["torch rng"])
    for key in before.keys() - {"values", "torch rng"}:
        assert before[key] == after[key], key


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_a_prediction_leaves_the_model_optimizer_and_rngs_bit_identical(case, hub):
    model, optimizer, batch, step = case.make()
    measured_peaks(hub, model, optimizer, batch, step)  # optimizer state, BatchNorm statistics
    for i, p in enumerate(model.parameters()):
        if i % 2:
            p.grad = torch.randn_like(p)  # gradients a script left, on some parameters
    random.seed(1)
    before = everything(model, optimizer)
    plan.predict(model, optimizer, batch, step)
    assert_unchanged(before, everything(model, optimizer))
    plan.predict(model, optimizer, batch, step, micro_batch=case.size // 2, checkpointing=True, amp="bf16")
    assert_unchanged(before, everything(model, optimizer))


def test_a_step_that_draws_from_python_and_numpy_leaves_their_generators_as_they_were():
    """An augmentation in step() (a random crop, noise) runs in the trace too: its draws are put back."""
    np = pytest.importorskip("numpy")
    model, optimizer, batch, step = BY_NAME["demo MLP"].make()
    draws: list[float] = []

    def augmenting(model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        draws.append(random.random() + np.random.rand())
        return step(model, (x * (1 + random.random()) + torch.randn_like(x), y))

    python, numpy, torch_rng = random.getstate(), np.random.get_state(), torch.get_rng_state()
    plan.predict(model, optimizer, batch, augmenting)
    assert len(draws) == 2  # a fresh optimizer: two steps traced
    assert random.getstate() == python and torch.equal(torch.get_rng_state(), torch_rng)
    after = np.random.get_state()
    assert after[0] == numpy[0] and np.array_equal(after[1], numpy[1]) and after[2:] == numpy[2:]


def test_training_after_predictions_is_what_it_would_have_been(hub):
    """GPT-2's dropout draws from the RNG at every step: predictions between steps (checkpointing on,
    whose default would save and restore the RNG) change no loss and no weight."""
    case = BY_NAME["HF GPT2LMHeadModel"]
    runs = []
    for predicting in (False, True):
        model, optimizer, batch, step = case.make()
        losses = []
        for _ in range(3):
            if predicting:
                plan.predict(model, optimizer, batch, step, checkpointing=True, micro_batch=4)
            losses.append(gputui.fit(model, [batch], step, optimizer).loss)
        runs.append((losses, dict(model.named_parameters())))
    (plain_losses, plain_weights), (losses, weights) = runs
    assert losses == plain_losses
    assert_same_tensors(weights, plain_weights, atol=0, rtol=0)


def test_fits_checkpointing_on_the_model_still_works_and_the_copy_never_calls_the_real_blocks(hub):
    model, optimizer, batch, step = BY_NAME["demo GPT"].make()
    checkpointing = Checkpointing(model)
    checkpointing.set(True)
    wrappers = [vars(block)["forward"] for block in checkpointing.blocks]
    real = {id(m) for m in model.modules()}
    called: list[bool] = []  # a hook the copy inherits: whether each module called was a real one
    for module in model.modules():
        module.register_forward_pre_hook(lambda module, args: called.append(id(module) in real))
    for settings in ({}, {"checkpointing": True, "amp": "bf16"}):
        plan.predict(model, optimizer, batch, step, **settings)
        assert called and not any(called), settings  # the copy ran its own blocks, never the model's
        called.clear()
    assert [vars(block)["forward"] for block in checkpointing.blocks] == wrappers

    kept: list[tuple[Any, ...]] = []
    checkpointing.on_inputs = kept.append
    step(model, batch).backward()
    assert len(kept) == len(checkpointing.blocks) and all(called)  # the wrappers checkpointed each block
    checkpointed = {n: p.grad for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    checkpointing.set(False)
    step(model, batch).backward()
    assert_same_tensors({n: p.grad for n, p in model.named_parameters()}, checkpointed)
    checkpointing.remove()


class ReadsItsData(nn.Module):
    """Control flow on a value of the data: a fake tensor has none to branch on."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) if x.sum().item() > 0 else self.b(x)


class ShapedByItsData(nn.Module):
    """Boolean-mask indexing: the output's shape is how many values are positive."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        return y[y > 0]


def squares(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).pow(2).mean()


def test_a_step_that_reads_a_value_of_its_data_is_predicted_as_approximate(hub):
    """The trace answers .item() with a stand-in and takes that branch: both branches hold the same here,
    but in general the other could hold more, so the prediction says it is not exact, and why."""
    torch.manual_seed(0)
    model = ReadsItsData()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    batch = torch.randn(8, 8)
    p = plan.predict(model, optimizer, batch, squares)
    assert not p.exact and p.reason is not None and "(.item(), bool())" in p.reason, p.reason
    first, second = measured_peaks(hub, model, optimizer, batch, squares, steps=2)
    assert abs(error(p.tracked_peak, max(first, second))) <= TOLERANCE, (p.tracked_peak, first, second)


_LIBRARY = torch.library.Library("gputui_test_plan", "DEF")  # a custom op that takes its tensors in a dict
_LIBRARY.define("plus(Tensor x, Dict(str, Tensor) d) -> Tensor")
_LIBRARY.impl("plus", lambda x, d: x + d["a"], "CompositeExplicitAutograd")
torch.library.register_fake("gputui_test_plan::plus", lambda x, d: torch.empty_like(x), lib=_LIBRARY)


def test_a_real_tensor_the_step_brings_is_traced_as_its_fake_and_one_that_requires_grad_is_refused(hub):
    """Class weights the step keeps (real, on the device) are swapped for fakes op by op, wherever an op
    takes them (an argument, a list, a custom op's dict), and a real scalar's value is read as it is;
    a tensor that requires grad outside the model cannot be (autograd would accumulate into the real one)."""
    model, optimizer, batch, _ = BY_NAME["demo MLP"].make()
    weights, keep, shift, temperature = (
        torch.rand(10) + 0.5,
        torch.arange(10),
        {"a": torch.zeros(16, 10)},
        torch.tensor(2.0),
    )

    def weighted(m: nn.Module, b: Any) -> torch.Tensor:
        bias = torch.ops.gputui_test_plan.plus(b[0][:, :10], shift)  # of the batch: no gradient through it
        logits = (torch.cat([m(b[0])[:, keep]]) + bias) / temperature.item()
        return nn.functional.cross_entropy(logits, b[1], weight=weights)

    p = plan.predict(model, optimizer, batch, weighted)
    measured = max(measured_peaks(hub, model, optimizer, batch, weighted, steps=2))
    assert p.exact and abs(error(p.tracked_peak, measured)) <= TOLERANCE, (p.tracked_peak, measured, p.reason)
    scale = torch.ones(10, requires_grad=True)
    with pytest.raises(plan.Untraceable, match="requires grad outside the model"):
        plan.predict(model, optimizer, batch, lambda m, b: (m(b[0]) * scale).logsumexp(1).mean())


def test_a_lazy_module_before_its_first_forward_is_untraceable_and_says_so():
    model = nn.Sequential(nn.LazyLinear(4), nn.ReLU(), nn.Linear(4, 1))
    with pytest.raises(plan.Untraceable, match=r"parameters not made yet \(a Lazy module before its first forward\)"):
        plan.predict(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(8, 3), squares)


def test_a_shape_that_depends_on_the_data_is_untraceable_and_the_estimate_says_why():
    torch.manual_seed(0)
    model = ShapedByItsData()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(plan.Untraceable) as raised:
        plan.predict(model, optimizer, torch.randn(8, 8), squares)
    reason = str(raised.value)
    assert "depends on the data (nonzero" in reason, reason
    measured = {"parameters": 1000, "gradients": 1000, "optimizer": 2000, "activations": 800, "temporaries": 80}
    estimate = plan.estimate(
        measured, 8, "off", False, micro_batch=4, amp="bf16", checkpointing=True, blocks=4, reason=reason
    )
    assert not estimate.exact and estimate.reason == reason
    # activations and temporaries: half the micro-batch, half under bf16, a quarter with 4 blocks checkpointed
    assert estimate.breakdown == measured | {"activations": 50, "temporaries": 5}
    assert (estimate.peak, estimate.tracked_peak) == (4055, 4050)
    assert (estimate.micro_batch, estimate.amp, estimate.checkpointing) == (4, "bf16", True)
    same = plan.estimate(measured, 8, "off", False, micro_batch=8, amp="off", checkpointing=False, blocks=4, reason="")
    assert same.peak == sum(measured.values())


@pytest.mark.parametrize("warm", [False, True], ids=["fresh optimizer", "optimizer with state"])
def test_predicting_never_steps_the_real_optimizer_nor_its_scheduler_or_hooks(warm, hub):
    model, optimizer, batch, step = BY_NAME["demo MLP"].make()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5**s)  # wraps optimizer.step
    if warm:
        gputui.fit(model, [batch], step, optimizer, scheduler=scheduler)
    hooks: list[str] = []
    optimizer.register_step_pre_hook(lambda *args: hooks.append("pre"))
    optimizer.register_step_post_hook(lambda *args: hooks.append("post"))
    wrapped = vars(optimizer)["step"]

    def counters() -> tuple[Any, ...]:
        return scheduler.last_epoch, scheduler._step_count, scheduler.get_last_lr(), vars(optimizer).get("_opt_called")

    counted = counters()
    before = everything(model, optimizer)
    plan.predict(model, optimizer, batch, step, amp="bf16", micro_batch=4)
    assert bool(optimizer.state) == warm
    assert_unchanged(before, everything(model, optimizer))
    assert vars(optimizer)["step"] is wrapped and hooks == []
    assert counters() == counted


PRIVATE = re.compile(r"torch\._|_pytree|_python_dispatch|_disable_current_modes|_lru_cache_wrapper|\._cdata|\._orig")
"""A few of the private torch (and functools) names the planner uses: none may appear outside private.py."""


def test_the_planners_private_apis_are_used_in_one_module():
    """A torch release that moves a private API the planner relies on is mended in plan/private.py alone."""
    modules = Path(plan.__file__).parent.glob("*.py")
    users = {m.name for m in modules if m.name != "private.py" and PRIVATE.search(m.read_text())}
    assert users == set()
    assert PRIVATE.search((Path(plan.__file__).parent / "private.py").read_text())
