"""A torch.compile'd model through fit: gputui's hooks are invisible to dynamo, so nothing recompiles
or warns, and the compiled model trains as the uncompiled one does, budget and OOM recovery included.

Each case runs in a child process: dynamo's caches, logs and its import (which changes how the
hooks are made) stay out of the test process. The "aot_eager" backend goes through dynamo and
AOTAutograd as inductor does, without a C++ compiler's seconds (inductor also warns on its own).
"""

import json
import textwrap

import pytest
from process import python

CHILD = """
import copy, json, warnings
import torch
from torch import nn
import gputui

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, x):
        return x + torch.tanh(self.linear(x))

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)

def step(model, batch):
    return nn.functional.cross_entropy(model(batch[0]), batch[1])

torch.manual_seed(0)
start = Net()
g = torch.Generator().manual_seed(0)
batches = [(torch.randn(16, 16, generator=g), torch.randint(4, (16,), generator=g)) for _ in range(3)]

def train(compiled, checkpointing, budget):
    model = copy.deepcopy(start)
    run = torch.compile(model, backend="aot_eager") if compiled else model
    result = gputui.fit(run, batches, step, torch.optim.SGD(model.parameters(), lr=0.1),
                        checkpointing=checkpointing, memory_budget=budget)
    return model, result

cases = []
for checkpointing in (False, True):
    for budget in (None, "8KiB"):  # 8 KiB: a micro-batch of 16 does not fit, with or without checkpointing
        reference, expected = train(False, checkpointing, budget)
        torch._dynamo.reset()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model, result = train(True, checkpointing, budget)
        cases.append({
            "checkpointing": checkpointing, "budget": budget, "warnings": [str(w.message) for w in caught],
            "steps": result.steps, "ooms": result.ooms_recovered, "reference_ooms": expected.ooms_recovered,
            "trained": [torch.allclose(a, b, atol=1e-5) and not torch.equal(a, c) for a, b, c
                        in zip(model.parameters(), reference.parameters(), start.parameters(), strict=True)],
        })
json.dump(cases, open("cases.json", "w"))
"""


@pytest.mark.timeout(300)  # the child's own bound is 240 s: compiling can be slow on a cold machine
def test_a_compiled_model_trains_through_fit_without_recompiles_or_warnings(tmp_path):
    script = tmp_path / "compiled.py"
    script.write_text(textwrap.dedent(CHILD))
    done = python(script, cwd=tmp_path, timeout=240)
    assert done.returncode == 0, done.stderr
    # dynamo reports a recompile past its limit (or any trouble) through logging, on stderr
    assert "torch._dynamo" not in done.stderr and "recompil" not in done.stderr, done.stderr
    cases = json.loads((tmp_path / "cases.json").read_text())
    assert [(c["checkpointing"], c["budget"]) for c in cases] == [
        (False, None),
        (False, "8KiB"),
        (True, None),
        (True, "8KiB"),
    ]
    for case in cases:
        assert case["warnings"] == [] and case["steps"] == 3, case
        assert all(case["trained"]), case  # the same weights as uncompiled, and changed by training
        if case["budget"]:  # the budget still raises inside the compiled graph's hooks, and fit recovers
            assert case["ooms"] >= 1 and case["reference_ooms"] >= 1, case
