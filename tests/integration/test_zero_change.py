"""Zero-change mode: scripts with their own loops, written the way people write them, run unchanged.

Each runs under plain python and under `gputui run --headless --metrics`: the output and files
must be the same, and the losses gputui records must be the ones the script computed.
"""

import importlib.util
import json
import os
import textwrap

import pytest
from process import python

PRELUDE = """
import json, sys, time
import torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
x, y = torch.randn(320, 16), torch.randint(4, (320,))
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32)
computed = []
"""

SAVE = """
json.dump(computed, open("computed.json", "w"))
"""

SCRIPTS = {
    "tqdm": PRELUDE
    + """
from tqdm import tqdm
for epoch in range(2):
    bar = tqdm(loader, desc=f"epoch {epoch}")
    for xb, yb in bar:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(xb), yb)
        loss.backward()
        opt.step()
        computed.append(loss.item())
        bar.set_postfix(loss=f"{loss.item():.4f}")
"""
    + SAVE,
    "every_n": PRELUDE
    + """
for step, (xb, yb) in enumerate(loader):
    loss = nn.functional.cross_entropy(model(xb), yb)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    computed.append(loss.item())
    if step % 3 == 0:
        print(f"step {step} loss: {loss.item():.4f}")
"""
    + SAVE,
    "dict_logs": PRELUDE
    + """
for step, (xb, yb) in enumerate(loader):
    loss = nn.functional.cross_entropy(model(xb), yb)
    loss.backward()
    opt.step()
    model.zero_grad()
    computed.append(loss.item())
    print({"loss": round(loss.item(), 4), "learning_rate": 0.01, "epoch": round(step / 10, 2)})
"""
    + SAVE,
    "fetch_ahead": PRELUDE
    + """
def ahead(loader):  # as accelerate's DataLoaderShard (and so the HF Trainer) does, to know the last batch
    it = iter(loader)
    current = next(it)
    for upcoming in it:
        yield current
        current = upcoming
    yield current

val = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x[:64], y[:64]), batch_size=16)
for epoch in range(2):
    for step, (xb, yb) in enumerate(ahead(loader)):
        loss = nn.functional.cross_entropy(model(xb), yb)
        loss.backward(); opt.step(); opt.zero_grad()
        computed.append(loss.item())
        if epoch == 1 and step == 4:
            break  # stopped mid-epoch: the batch fetched ahead was never trained on
    with torch.no_grad():  # an evaluation, and one fetching with gradients on (HF's evaluation loop does)
        val_loss = sum(nn.functional.cross_entropy(model(xv), yv).item() for xv, yv in val) / len(val)
    outputs = [model(xv).sum() for xv, yv in val]
    print(f"step {len(computed)}: train loss {computed[-1]:.4f}, val loss {val_loss:.4f}")
"""
    + SAVE,
    "argv_and_file": PRELUDE
    + """
steps = int(sys.argv[1]); out = sys.argv[2]
for step in range(steps):
    xb, yb = x[step * 8:(step + 1) * 8], y[step * 8:(step + 1) * 8]
    loss = nn.functional.cross_entropy(model(xb), yb)
    opt.zero_grad(); loss.backward(); opt.step()
    computed.append(loss.item())
torch.save(model.state_dict(), out)
print("wrote", out, "after", steps, "steps")
"""
    + SAVE,
}


def run(tmp_path, name, code, argv, gputui_args=None):
    folder = tmp_path / ("gputui" if gputui_args is not None else "plain")
    folder.mkdir()
    script = folder / f"my_{name}.py"  # not tqdm.py: a script named like a module shadows it
    script.write_text(textwrap.dedent(code))
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700, exist_ok=True)
    env = {**os.environ, "XDG_RUNTIME_DIR": str(runtime), "PYTHONHASHSEED": "0"}
    gputui = [] if gputui_args is None else ["-m", "gputui", "run", "--headless", *gputui_args]
    return python(*gputui, script, *argv, cwd=folder, env=env), folder


def steps_of(metrics):
    return [json.loads(line) for line in metrics.read_text().splitlines() if '"kind":"step"' in line]


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_own_loop_runs_unchanged_and_its_losses_are_recorded(tmp_path, name):
    argv = ["7", "model.pt"] if name == "argv_and_file" else []
    plain, plain_dir = run(tmp_path, name, SCRIPTS[name], argv)
    metrics = tmp_path / "m.jsonl"
    ours, our_dir = run(tmp_path, name, SCRIPTS[name], argv, ["--metrics", str(metrics)])
    assert plain.returncode == ours.returncode == 0, ours.stderr
    assert ours.stdout == plain.stdout
    if name != "tqdm":  # tqdm's stderr carries timings; the rest must match too
        assert ours.stderr == plain.stderr.replace(NUMPY_WARNING, "")
    computed = json.loads((our_dir / "computed.json").read_text())
    assert computed == json.loads((plain_dir / "computed.json").read_text())
    steps = steps_of(metrics)
    assert [s["step"] for s in steps] == list(range(1, len(computed) + 1))
    assert [s["loss"] for s in steps] == pytest.approx(computed, rel=1e-6)
    assert {s["loss_source"] for s in steps} == {"backward()"}
    if name == "argv_and_file":
        import torch  # only to read what the scripts saved
        from helpers import assert_same_tensors

        ours_saved, plain_saved = torch.load(our_dir / "model.pt"), torch.load(plain_dir / "model.pt")
        assert_same_tensors(ours_saved, plain_saved, atol=0, rtol=0)  # the same training, bit for bit
    else:  # each step counts the batch it trained on, in the epoch it was fetched in
        assert [(s["batch_size"], s["samples"]) for s in steps] == [(32, 32 * s["step"]) for s in steps]
        epochs, done = EPOCHS[name]
        assert [s["epoch"] for s in steps] == epochs
        assert json.loads(metrics.read_text().splitlines()[-1])["epochs"] == done


GAN = """
import json, sys
import torch
from torch import nn
torch.manual_seed(0)
G = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))
D = nn.Sequential(nn.Linear(2, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))
made = {}
for k in (sys.argv[1], "G" if sys.argv[1] == "D" else "D"):  # the optimizer made first is the one watched
    made[k] = torch.optim.Adam((D if k == "D" else G).parameters(), lr=1e-3)
optD, optG = made["D"], made["G"]
bce = nn.BCEWithLogitsLoss()
computed = {"D": [], "G": []}
for it in range(6):
    real, fake = torch.randn(16, 2) * 0.5 + 2, G(torch.randn(16, 8))
    optD.zero_grad()
    lossD = bce(D(real), torch.ones(16, 1)) + bce(D(fake.detach()), torch.zeros(16, 1))
    lossD.backward(); optD.step()
    optG.zero_grad(); lossG = bce(D(fake), torch.ones(16, 1)); lossG.backward(); optG.step()
    computed["D"].append(lossD.item()); computed["G"].append(lossG.item())
json.dump(computed, open("computed.json", "w"))
"""


@pytest.mark.parametrize("first", ["D", "G"])
def test_two_models_each_stepping_its_own_optimizer_record_the_watched_ones_losses(tmp_path, first):
    """A GAN: the discriminator and the generator each backward their own loss and step their own optimizer.
    gputui watches the optimizer made first; each of its steps records its own loss, not the other's
    before it (a step's loss was lossD(t) + lossG(t-1), its accumulation 2)."""
    metrics = tmp_path / "m.jsonl"
    ours, folder = run(tmp_path, "gan", GAN, [first], ["--metrics", str(metrics)])
    assert ours.returncode == 0, ours.stderr
    computed = json.loads((folder / "computed.json").read_text())[first]
    steps = steps_of(metrics)
    assert [s["loss"] for s in steps] == pytest.approx(computed, rel=1e-6)
    assert {s["accumulation"] for s in steps} == {1}


EPOCHS = {  # name: (each step's epoch, from 0; the epochs completed)
    "tqdm": ([0] * 10 + [1] * 10, 2),
    "every_n": ([0] * 10, 1),
    "dict_logs": ([0] * 10, 1),
    "fetch_ahead": ([0] * 10 + [1] * 5, 1),
}


NUMPY_WARNING = ""  # torch's "Failed to initialize NumPy" warning, which gputui filters, is matched below


@pytest.fixture(autouse=True, scope="module")
def numpy_warning():
    """torch warns on import without NumPy; gputui silences that one line, nothing else (what it warns
    is the same for every test here: read once)."""
    global NUMPY_WARNING
    NUMPY_WARNING = python("-c", "import torch").stderr


def test_printed_losses_when_backward_sees_no_scalar(tmp_path):
    code = (
        PRELUDE
        + """
for step, (xb, yb) in enumerate(loader):
    losses = nn.functional.cross_entropy(model(xb), yb, reduction="none")
    losses.backward(torch.full_like(losses, 1 / len(losses)))  # no scalar: the loss comes from the print
    opt.step(); opt.zero_grad()
    computed.append(round(losses.mean().item(), 4))
    print(f"iter {step}: loss {losses.mean().item():.4f}")
"""
        + SAVE
    )
    metrics = tmp_path / "m.jsonl"
    done, folder = run(tmp_path, "vector", code, [], ["--metrics", str(metrics)])
    assert done.returncode == 0, done.stderr
    steps = steps_of(metrics)
    computed = json.loads((folder / "computed.json").read_text())
    # a print comes after its step: step N carries the loss printed after step N-1
    assert [s["loss"] for s in steps[1:]] == computed[:-1]
    assert steps[-1]["loss_source"] == "printed"


def test_a_script_that_raises_fails_as_under_python(tmp_path):
    code = (
        PRELUDE
        + """
for step, (xb, yb) in enumerate(loader):
    loss = nn.functional.cross_entropy(model(xb), yb)
    loss.backward(); opt.step(); opt.zero_grad()
    if step == 3:
        raise ValueError("label 9 is out of range")
"""
    )
    plain, _ = run(tmp_path, "raises", code, [])
    metrics = tmp_path / "m.jsonl"
    ours, _ = run(tmp_path, "raises", code, [], ["--metrics", str(metrics)])
    assert plain.returncode == ours.returncode == 1
    assert ours.stderr.splitlines()[-1] == "gputui: my_raises.py failed: ValueError: label 9 is out of range"
    assert 'my_raises.py", line' in ours.stderr and "gputui/launch.py" not in ours.stderr
    end = json.loads(metrics.read_text().splitlines()[-1])
    assert end["kind"] == "end" and end["steps"] == 4 and "label 9" in end["error"]


def test_an_oom_is_diagnosed_and_fails_with_the_scripts_code(tmp_path):
    code = """
import torch
from torch import nn
model = nn.Sequential(*[nn.Sequential(nn.Linear(128, 512), nn.GELU(), nn.Linear(512, 128)) for _ in range(3)])
opt = torch.optim.AdamW(model.parameters())

def train_step(x):
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step(); opt.zero_grad()
    return loss.item()

for step in range(200):
    train_step(torch.randn(64 * (step + 1), 128))
    print("step", step)
"""
    metrics = tmp_path / "m.jsonl"
    done, _ = run(tmp_path, "grows", code, [], ["--metrics", str(metrics), "--memory-budget", "24MiB"])
    assert done.returncode == 1
    err = done.stderr
    assert "gputui: out of memory in backward at my_grows.py:" in err and " in train_step: loss.backward()" in err
    assert "memory then: allocated" in err and "largest tensors:" in err and "what would fit here:" in err
    assert "gputui.fit would have caught this OOM" in err
    assert err.splitlines()[-1].startswith("gputui: my_grows.py failed: OutOfMemoryError: CPU memory budget exceeded")
    oom = [json.loads(x) for x in metrics.read_text().splitlines() if '"name":"oom"' in x]
    assert oom and oom[0]["diagnosis"] is True and oom[0]["top"] and oom[0]["where"].startswith("my_grows.py:")


def test_a_compiled_model_is_watched_without_recompiles(tmp_path):
    """The observer's saved-tensor hooks are installed before the script compiles anything; an op
    dynamo cannot put in a graph (a boolean mask) runs eagerly inside the compiled frame and saves
    tensors through them, and dynamo must not compile them (recompiling past its limit, warning)."""
    code = (
        PRELUDE
        + """
class Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = model

    def forward(self, x):
        h = self.inner[1](self.inner[0](x))
        return self.inner[2](h[h.sum(dim=1) > -1e9])  # data-dependent shape: a graph break

compiled = torch.compile(Masked(), backend="aot_eager")
for step, (xb, yb) in enumerate(loader):
    loss = nn.functional.cross_entropy(compiled(xb), yb)
    loss.backward(); opt.step(); opt.zero_grad()
    computed.append(loss.item())
"""
        + SAVE
    )
    metrics = tmp_path / "m.jsonl"
    done, folder = run(tmp_path, "compiled", code, [], ["--metrics", str(metrics), "--memory-budget", "1GiB"])
    assert done.returncode == 0, done.stderr
    assert "torch._dynamo" not in done.stderr and "recompil" not in done.stderr, done.stderr
    steps = steps_of(metrics)
    assert [s["loss"] for s in steps] == pytest.approx(json.loads((folder / "computed.json").read_text()), rel=1e-6)
    assert steps[-1]["peak"] > steps[-1]["memory"]["params"]  # the saved activations were counted


def installed(name):
    return pytest.mark.skipif(
        importlib.util.find_spec(name) is None, reason=f"{name} is not installed (pip install -e '.[integration]')"
    )


@installed("transformers")
def test_hugging_face_trainer_steps_count_the_batches_they_train_on(tmp_path):
    """The Trainer fetches a batch ahead (accelerate) and prints its logs with quoted values
    (transformers 5); built from a config, nothing is downloaded."""
    code = """
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16))

class Tokens(torch.utils.data.Dataset):
    ids = torch.randint(64, (40, 8))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}

args = TrainingArguments(output_dir="out", per_device_train_batch_size=8, max_steps=7, logging_steps=1,
                         save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True)
Trainer(model=model, args=args, train_dataset=Tokens()).train()
"""
    metrics = tmp_path / "m.jsonl"
    done, _ = run(tmp_path, "hf_trainer", code, [], ["--metrics", str(metrics)])
    assert done.returncode == 0, done.stderr
    steps = steps_of(metrics)  # 5 batches of 8 an epoch; stopped 2 steps into the second
    assert [(s["batch_size"], s["samples"], s["epoch"]) for s in steps] == [(8, 8 * n, 0) for n in range(1, 6)] + [
        (8, 48, 1),
        (8, 56, 1),
    ]
    assert json.loads(metrics.read_text().splitlines()[-1])["epochs"] == 1


@installed("accelerate")
def test_accelerate_loop_with_accumulation_counts_batches_and_epochs(tmp_path):
    code = (
        PRELUDE
        + """
from accelerate import Accelerator
accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
model, opt, loader = accelerator.prepare(model, opt, loader)
for epoch in range(2):
    for xb, yb in loader:
        with accelerator.accumulate(model):
            loss = nn.functional.cross_entropy(model(xb), yb)
            accelerator.backward(loss); opt.step(); opt.zero_grad()
"""
    )
    metrics = tmp_path / "m.jsonl"
    done, _ = run(tmp_path, "accelerate_loop", code, [], ["--metrics", str(metrics)])
    assert done.returncode == 0, done.stderr
    steps = steps_of(metrics)  # 10 batches of 32 an epoch, two a step
    assert [(s["batch_size"], s["accumulation"], s["samples"], s["epoch"]) for s in steps] == [
        (64, 2, 64 * n, int(n > 5)) for n in range(1, 11)
    ]
    assert json.loads(metrics.read_text().splitlines()[-1])["epochs"] == 2


def test_file_and_argv0_are_what_python_sets(tmp_path):
    (tmp_path / "where.py").write_text("import sys\nprint(__file__, sys.argv[0], __name__)\n")
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path)}
    plain = python("where.py", cwd=tmp_path, env=env)
    ours = python("-m", "gputui", "run", "--headless", "where.py", cwd=tmp_path, env=env)
    assert ours.returncode == 0, ours.stderr
    assert ours.stdout == plain.stdout == f"{tmp_path / 'where.py'} where.py __main__\n"
