"""The real trainers, each script run unchanged under plain python and under `gputui run --headless`.

A Hugging Face Trainer, a Lightning Trainer and an accelerate loop, each with a tiny model built in
the script and synthetic data (nothing downloaded: the Hugging Face offline switches are set). gputui
must count the trainer's optimizer steps exactly, record the losses the trainer logs (to the precision
it prints them), leave the script's output as python shows it (timings aside) and exit with the
script's code. The libraries are the `integration` extra (pip install -e '.[integration]'); each test
is skipped without its library. zero-change tests of batches and samples are in test_zero_change.py.
"""

import ast
import importlib.util
import json
import math
import os
import re
import subprocess
import textwrap

import pytest
from process import python

TIMEOUT = 55  # seconds a run may take (~5 s here, most of it importing the library): two fit in pytest's 120

OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}

HF_TRAINER = """
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

torch.manual_seed(0)
config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0, eos_token_id=0)


class Tokens(torch.utils.data.Dataset):
    ids = torch.randint(64, (40, 8))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


args = TrainingArguments(
    output_dir="out", per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=7, logging_steps=1,
    save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True,
)
trainer = Trainer(model=GPT2LMHeadModel(config), args=args, train_dataset=Tokens())
trainer.train()
print("global_step", trainer.state.global_step, "epoch", trainer.state.epoch)
"""

LIGHTNING = """
import lightning as L
import torch
from torch import nn


class Regression(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


torch.manual_seed(0)
x = torch.randn(80, 16)
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=16)
trainer = L.Trainer(
    accelerator="cpu", devices=1, max_steps=7, logger=False, enable_checkpointing=False, enable_model_summary=False,
    enable_progress_bar=True, callbacks=[L.pytorch.callbacks.TQDMProgressBar()],  # tqdm's bar, not rich's
)
trainer.fit(Regression(), loader)
print("global_step", trainer.global_step, "epoch", trainer.current_epoch)
"""

ACCELERATE = """
import sys

import torch
from accelerate import Accelerator
from torch import nn


def main():
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = torch.randn(320, 16), torch.randint(4, (320,))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32, shuffle=True)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    completed_steps, window = 0, []
    for epoch in range(2):
        for xb, yb in loader:
            with accelerator.accumulate(model):
                loss = nn.functional.cross_entropy(model(xb), yb)
                accelerator.backward(loss)
                opt.step()
                opt.zero_grad()
                window.append(loss.item())
            if accelerator.sync_gradients:
                completed_steps += 1
                accelerator.print(f"epoch {epoch} step {completed_steps}: loss {sum(window) / len(window):.6f}")
                window = []
    accelerator.print("global_step", completed_steps, "epoch", epoch + 1)
    return 3  # a code of its own, which gputui must pass on


if __name__ == "__main__":
    sys.exit(main())
"""

SCRIPTS = {"hf_trainer": HF_TRAINER, "lightning": LIGHTNING, "accelerate": ACCELERATE}

TIMINGS = [  # what differs between two runs of the same training: durations and rates
    (re.compile(r"'(train_runtime|train_samples_per_second|train_steps_per_second)': '?[\d.e+-]+'?"), r"'\1': T"),
    (re.compile(r"\d+:\d\d"), "M:SS"),
    (re.compile(r"[\d.]+[kMG]?(it/s|s/it)"), r"R\1"),
    (re.compile(r" +(?=[\r\n]|$)"), ""),  # tqdm's spaces over a longer redraw before (its rate had more digits)
]


class Ran:
    """One script, run under plain python and under gputui in folders of their own."""

    def __init__(self, folder, name):
        self.code = textwrap.dedent(SCRIPTS[name])
        self.metrics = folder / "m.jsonl"
        self.plain = self._run(folder / "plain", [])
        self.ours = self._run(folder / "gputui", ["-m", "gputui", "run", "--headless", "--metrics", str(self.metrics)])
        lines = [json.loads(line) for line in self.metrics.read_text().splitlines()]
        self.steps = [x for x in lines if x["kind"] == "step"]
        self.end = lines[-1]
        found = re.search(r"^global_step (\d+) epoch ([\d.]+)$", self.plain.stdout, re.MULTILINE)
        assert found, self.plain.stdout
        self.global_step, self.epoch = int(found[1]), float(found[2])

    def _run(self, folder, gputui):
        folder.mkdir()
        (folder / "train.py").write_text(self.code)
        runtime = folder / "run"
        runtime.mkdir(mode=0o700)
        env = {
            **os.environ,
            **OFFLINE,
            "HF_HOME": str(folder / "hf"),  # nothing read from or written to the user's cache
            "XDG_RUNTIME_DIR": str(runtime),
            "PYTHONHASHSEED": "0",
        }
        # bytes decoded as they are: text mode would turn a progress bar's \r into \n
        done = python(*gputui, "train.py", cwd=folder, env=env, timeout=TIMEOUT, text=False)
        out, err = (s.decode().replace(str(folder), "<folder>") for s in (done.stdout, done.stderr))
        return subprocess.CompletedProcess(done.args, done.returncode, out, err)

    def check_unchanged(self, code):
        assert self.plain.returncode == code, self.plain.stderr
        assert self.ours.returncode == code, self.ours.stderr
        assert untimed(self.ours.stdout) == untimed(self.plain.stdout)
        assert untimed(self.ours.stderr) == untimed(self.plain.stderr)

    def check_steps(self):
        assert self.end["kind"] == "end" and self.end["steps"] == self.global_step
        assert [s["step"] for s in self.steps] == list(range(1, self.global_step + 1))
        assert {s["loss_source"] for s in self.steps} == {"backward()"}


def untimed(text):
    for pattern, replacement in TIMINGS:
        text = pattern.sub(replacement, text)
    return text


def close(ours, printed, significant=None):
    """`ours` rounds to `printed`: within half a unit of its last digit (`significant` digits if the
    trainer prints so many and drops trailing zeros, or pads them), with float32's slack."""
    value = float(printed)
    if significant is not None:
        unit = 10 ** (math.floor(math.log10(abs(value))) - significant + 1)
    else:
        unit = 10.0 ** -len(printed.partition(".")[2])
    return abs(ours - value) <= unit / 2 + 1e-6 * abs(value)


def installed(name):
    return pytest.mark.skipif(
        importlib.util.find_spec(name) is None, reason=f"{name} is not installed (pip install -e '.[integration]')"
    )


@pytest.fixture(scope="session")
def ran(tmp_path_factory):
    """Each script's two runs, made once a test process (two tests may read the same runs)."""
    runs = {}

    def get(name):
        if name not in runs:
            runs[name] = Ran(tmp_path_factory.mktemp(name), name)
        return runs[name]

    return get


@installed("transformers")
def test_hugging_face_trainer(ran):
    """transformers 5 prints each log with values quoted and 4 significant digits; with gradient
    accumulation each optimizer step is two batches, and the logged loss their mean."""
    run = ran("hf_trainer")
    run.check_unchanged(0)
    run.check_steps()
    logs = [ast.literal_eval(line) for line in run.plain.stdout.splitlines() if line.startswith("{'loss'")]
    assert len(logs) == run.global_step == 7
    for step, log in zip(run.steps, logs, strict=True):
        assert close(step["loss"], str(log["loss"]), significant=4), (step["loss"], log)
        assert step["epoch"] == math.ceil(float(log["epoch"])) - 1  # the Trainer's epoch: 0.2 a step, 1.0 ends one
        assert (step["batch_size"], step["accumulation"]) == (8, 2)
    assert run.end["epochs"] == int(run.epoch) == 1


def bar_steps(stdout):
    """(epoch, loss) at each batch, as the last redraw of tqdm's bar for that batch shows it."""
    shown = {}
    for redraw in re.split(r"[\r\n]", stdout):
        found = re.match(r"Epoch (\d+): .*?\| (\d+)/\d+ \[.*train_loss=([\d.]+)\]", redraw)
        if found and int(found[2]) > 0:
            shown[int(found[1]), int(found[2])] = found[3]
    return [(epoch, loss) for (epoch, _), loss in sorted(shown.items())]


@installed("lightning")
def test_lightning_trainer(ran):
    """tqdm's bar redraws with \\r after each batch, showing the loss to 3 significant digits (padded);
    max_steps stops the second epoch after 2 of its 5 batches."""
    run = ran("lightning")
    run.check_unchanged(0)
    assert "\r" in run.ours.stdout and "\r" in run.plain.stdout
    run.check_steps()
    shown = bar_steps(run.plain.stdout)
    assert len(shown) == run.global_step == 7
    for step, (_, loss) in zip(run.steps, shown, strict=True):
        assert close(step["loss"], loss, significant=3), (step["loss"], loss)
        assert step["batch_size"] == 16 and step["accumulation"] == 1


@installed("lightning")
def test_lightning_trainer_epochs(ran):
    run = ran("lightning")
    assert [s["epoch"] for s in run.steps] == [epoch for epoch, _ in bar_steps(run.plain.stdout)]
    assert run.end["epochs"] == 1  # Lightning's current_epoch (2) counts the one max_steps cut short too


@installed("accelerate")
def test_accelerate_loop(ran):
    """accelerator.backward() divides each loss by the accumulation: the step's loss is the mean over
    its batches, as the script prints it; the script's own exit code comes through."""
    run = ran("accelerate")
    run.check_unchanged(3)
    run.check_steps()
    printed = re.findall(r"^epoch (\d+) step \d+: loss ([\d.]+)$", run.plain.stdout, re.MULTILINE)
    assert len(printed) == run.global_step == 10
    for step, (epoch, loss) in zip(run.steps, printed, strict=True):
        assert close(step["loss"], loss), (step["loss"], loss)
        assert step["epoch"] == int(epoch) and (step["batch_size"], step["accumulation"]) == (64, 2)
    assert run.end["epochs"] == int(run.epoch) == 2
