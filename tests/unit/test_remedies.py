import warnings

import pytest
import torch
from helpers import ConvNet, RequestAt, Sink, TokenModel, assert_same_weights, conv_batches, conv_step, twins
from torch import nn

import gputui
from gputui.step.checkpointing import Checkpointing, find_blocks
from gputui.step.precision import Precision


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


def checkpoints(model):
    """A Hugging Face model checkpoints when any of its layers' flags is set (what transformers reads)."""
    return any(getattr(m, "gradient_checkpointing", False) for m in model.modules())


def layer_state(model):
    """Each checkpointing layer's own flag and checkpoint function: what the script's enable() set."""
    attrs = ("gradient_checkpointing", "_gradient_checkpointing_func")
    return {
        name: tuple(vars(m).get(a) for a in attrs)
        for name, m in model.named_modules()
        if hasattr(m, "gradient_checkpointing")
    }


def test_older_hugging_face_models_use_their_own_switch():
    """Before transformers 5 there is only gradient_checkpointing_enable() and is_gradient_checkpointing."""
    calls = []

    class HFLike(nn.Module):
        supports_gradient_checkpointing = True

        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(3, 3) for _ in range(2))
            for layer in self.layers:
                layer.gradient_checkpointing = False

        @property
        def is_gradient_checkpointing(self):
            return checkpoints(self)

        def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
            calls.append(("enable", gradient_checkpointing_kwargs))
            for layer in self.layers:
                layer.gradient_checkpointing = True

        def gradient_checkpointing_disable(self):
            calls.append(("disable", None))

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    model = HFLike()
    switch = Checkpointing(model)
    assert switch.how == "hugging face" and switch.blocks == [] and not switch.enabled
    switch.set(True)
    assert checkpoints(model)
    switch.set(False)
    assert not checkpoints(model)
    switch.set(True)  # the layers enabled the first time, back: enable() is not called again
    assert checkpoints(model)
    switch.remove()
    assert calls == [("enable", {"use_reentrant": False})]
    assert not checkpoints(model) and "forward" not in vars(model.layers[0])
    assert Checkpointing(nn.Sequential(model)).how == "hugging face", "a wrapper's Hugging Face model is found"


@pytest.fixture
def gpt2():
    """A tiny GPT-2 built from its config (nothing downloaded), without dropout: runs compare exactly."""
    transformers = pytest.importorskip("transformers")

    def make(seed=0):
        torch.manual_seed(seed)
        config = transformers.GPT2Config(
            n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0, eos_token_id=0
        )
        config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
        return transformers.GPT2LMHeadModel(config)

    return make


def script_enables(model, kwargs=None):
    """What a script calls: the installed transformers' own API (the older name warns from 5 on)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def input_hooks(model):
    return list(model.get_input_embeddings()._forward_hooks)


def test_hugging_face_model_switches_its_own_checkpointing(gpt2):
    model = gpt2()
    before = layer_state(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # gradient_checkpointing_* go in transformers 6
        switch = Checkpointing(model)
        assert switch.how == "hugging face" and switch.blocks == [] and not switch.enabled
        switch.set(True)
        assert checkpoints(model) and len(input_hooks(model)) == 1
        assert model.transformer.h[0]._gradient_checkpointing_func.keywords == {"use_reentrant": False}
        switch.set(False)
        assert not checkpoints(model)
        switch.set(True)
        assert checkpoints(model) and len(input_hooks(model)) == 1, "enabled once: one input hook"
        switch.remove()
    assert not checkpoints(model) and layer_state(model) == before and input_hooks(model) == []
    assert not any("forward" in vars(m) for m in model.modules())


def test_hugging_face_model_keeps_the_scripts_own_setting(gpt2):
    model = gpt2()
    script_enables(model, {"use_reentrant": True})  # the script's choice, not gputui's
    before, hooks = layer_state(model), input_hooks(model)
    switch = Checkpointing(model)
    assert switch.enabled
    switch.set(False)
    assert not checkpoints(model)
    switch.set(True)
    assert layer_state(model) == before, "on again is the script's setting (its function, its use_reentrant)"
    switch.set(False)
    switch.remove()
    assert layer_state(model) == before and input_hooks(model) == hooks


class Seen(Sink):
    def on_start(self, info):
        self.info = info
        self.samples = []

    def on_sample(self, sample):
        self.samples.append(sample.checkpointing)

    def on_end(self, summary):
        self.summary = summary


def lm_step(model, ids):
    return model(input_ids=ids, labels=ids).loss


def lm_batches(n=4):
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(64, (4, 8), generator=generator) for _ in range(n)]


def runs_of(module):
    """How many times `module` runs: twice a step inside a checkpointed layer (recomputed in backward)."""
    runs = [0]
    handle = module.register_forward_pre_hook(lambda *_: runs.__setitem__(0, runs[0] + 1))
    return runs, handle


@pytest.mark.parametrize(
    ("script", "argument"), [(True, None), (True, True), (True, False), (False, None), (False, True), (False, False)]
)
def test_fit_starts_as_the_model_is_unless_told_and_leaves_it_as_the_script_set_it(gpt2, hub, script, argument):
    model = gpt2()
    if script:
        script_enables(model)
    before = layer_state(model)
    seen = Seen()
    hub.add_sink(seen)
    runs, handle = runs_of(model.transformer.h[0].mlp)
    result = gputui.fit(
        model, lm_batches(), lm_step, torch.optim.SGD(model.parameters(), lr=0.1), checkpointing=argument
    )
    handle.remove()
    hub.finish()  # the script ends: the run's end record
    on = script if argument is None else argument
    assert result.checkpointing == seen.summary.checkpointing == seen.info.checkpointing == on
    assert seen.info.checkpointing_how == "hugging face" and seen.samples == [on] * 4
    assert runs[0] == 4 * (2 if on else 1), "reported on exactly when the layers are recomputed"
    assert checkpoints(model) == script and layer_state(model) == before


def test_toggling_a_hugging_face_models_checkpointing_mid_run(gpt2, hub):
    model = gpt2()
    script_enables(model, {"use_reentrant": True})
    before = layer_state(model)
    seen = Seen()
    hub.add_sink(seen)
    hub.add_sink(RequestAt(hub, 2, "set_checkpointing", False))
    hub.add_sink(RequestAt(hub, 4, "set_checkpointing", True))
    result = gputui.fit(model, lm_batches(6), lm_step, torch.optim.SGD(model.parameters(), lr=0.1))
    assert seen.samples == [True, True, False, False, True, True] and result.checkpointing
    assert layer_state(model) == before


def test_hugging_face_checkpointing_trains_the_same(gpt2):
    """The same steps with and without checkpointing, however each was switched on, give the same weights."""
    models = [gpt2() for _ in range(4)]
    script_enables(models[1])
    script_enables(models[2])
    for model, argument in zip(models, (None, None, False, True), strict=True):
        gputui.fit(model, lm_batches(), lm_step, torch.optim.SGD(model.parameters(), lr=0.1), checkpointing=argument)
    for model in models[1:]:
        assert_same_weights(models[0], model, atol=1e-6, rtol=1e-5)


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
