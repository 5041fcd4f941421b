"""fit under torchrun on CPU: two gloo ranks, one thread each. Every launch is bounded (process.run's
timeout ends torchrun and its ranks), and the launches that fail a rank set the process group's own
timeout to 30 s, so a hang fails the test instead of blocking the suite. Scenarios are batched per
launch: a launch costs seconds."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from process import gputui, python
from torch import nn

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
LAUNCH_TIMEOUT = 120

# Shared by the ranks and the single-process reference: 22 samples in global batches of 8 (4 a rank),
# the last global batch of 6 split 4 / 2: an uneven last batch.
COMMON = """
import torch
from torch import nn


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))


def global_batches():
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(22, 4, generator=g), torch.randn(22, 1, generator=g)
    return [(x[s : s + 8], y[s : s + 8]) for s in range(0, 22, 8)]


def shard(batch, rank):
    x, y = batch
    return (x[:4], y[:4]) if rank == 0 else (x[4:], y[4:])


def step(model, batch):
    return nn.functional.mse_loss(model(batch[0]), batch[1])


# Token-mean losses over padded sequences of variable length: 3 global batches of 8, 4 a rank, the
# long sequences on rank 0 (so the ranks' token counts differ, as do the pieces').
def token_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(20, 8), nn.Tanh(), nn.Linear(8, 20))


def token_batches(empty=None):  # "last": each rank's last two samples all padding; "rank1": its whole share
    g = torch.Generator().manual_seed(3)
    batches = []
    for b in range(3):
        lengths = torch.tensor([7, 1, 2, 6, 1, 1, 2, 1]).roll(b)
        if empty == "last":
            lengths[2:4] = lengths[6:8] = 0
        elif empty == "rank1":
            lengths[4:] = 0
        labels = torch.randint(20, (8, 7), generator=g)
        labels[torch.arange(7) >= lengths[:, None]] = -100
        batches.append({"input_ids": torch.randint(20, (8, 7), generator=g), "labels": labels})
    return batches


def token_shard(batch, rank):
    return {k: v[:4] if rank == 0 else v[4:] for k, v in batch.items()}


def token_step(model, batch):
    logits = model(batch["input_ids"])
    return nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)


def masked_step(model, batch):  # the same mean, hand-written: over no tokens it is 0/0, and so is its gradient
    labels = batch["labels"].flatten()
    mask = labels != -100
    losses = nn.functional.cross_entropy(model(batch["input_ids"]).flatten(0, 1), labels.clamp(min=0), reduction="none")
    return (losses * mask).sum() / mask.sum()


def wide_batches():  # 2 global batches of 16: 8 a rank
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g)
    return [(x[s : s + 16], y[s : s + 16]) for s in (0, 16)]


def count_tokens(batch):
    return (batch["labels"] != -100).sum()


def bn_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 1))


def conv_model():  # channels_last: the gradient DDP's last bucket starts with is not contiguous
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Unflatten(1, (1, 2, 2)), nn.Conv2d(1, 4, 1), nn.Tanh(), nn.Conv2d(4, 1, 2, bias=False), nn.Flatten()
    )
    return model.to(memory_format=torch.channels_last)
"""

SCRIPT = """
import datetime, json, os, sys
import torch, torch.distributed as dist
from common import make_model, global_batches, shard, step, token_model, token_batches, token_shard, token_step
from common import bn_model, conv_model, count_tokens, masked_step
import gputui
from gputui.telemetry import hub as hubs
from helpers import RequestAt

out = sys.argv[1]
rank = int(os.environ["RANK"])
if sys.argv[2] == "own-group":
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=float(os.environ.get("PG_TIMEOUT", 30))))


IDENTITY = ("rank", "world_size", "local_rank", "node", "job")


def run(name, batches, make_hub=None, calls=(), wrap=False, optimizer=torch.optim.SGD, make_model=make_model,
        pre_hook=None, times=False, shard=False, **kwargs):
    hub = hubs.Hub()
    hubs.install(hub)
    if make_hub:
        make_hub(hub)
    model = make_model()
    if pre_hook is not None:
        model.register_forward_pre_hook(pre_hook)
    if shard:  # the script shards the model itself (FSDP2), then makes the optimizer
        from torch.distributed.fsdp import fully_shard
        fully_shard(model)
    optimizer = optimizer(model.parameters(), lr=0.1)
    record = {}
    try:
        fitted = torch.nn.parallel.DistributedDataParallel(model) if wrap else model
        result = gputui.fit(fitted, batches, step, optimizer, **kwargs)
    except gputui.FitError as exc:
        record["error"] = str(exc)
        record["notes"] = getattr(exc, "__notes__", [])
        result = exc.result
    record.update(
        steps=result.steps, epochs=result.epochs, stopped=result.stopped, rank=result.rank,
        world_size=result.world_size,
        events=[[e.name, e.step, e.details.get("to")] + ([e.t] if times else []) for e in hub.events()],
        ooms=[[e.name, e.step, e.details["phase"], e.details.get("micro_batch_to")]
              for e in hub.events() if e.name.startswith("oom")],
        calls=len(calls),
        norms=[s.grad_norm for s in hub.samples()],
        ranks=[r.to_json() for r in hub.latest().ranks] if hub.latest() else None,
        identity=[getattr(hub.info, k) for k in IDENTITY] if hub.info else None,
    )
    if not wrap:  # the DDP wrapper fit made (its gradient buckets, a copy of every gradient) goes with fit
        import gc
        gc.collect()
        record["ddp_alive"] = sum(isinstance(o, torch.nn.parallel.DistributedDataParallel) for o in gc.get_objects())
    if not (name == "fsdp-oom" and "error" in record):  # gathering the shards needs a group, gone there
        state = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
        torch.save(state, os.path.join(out, f"{name}.{rank}.pt"))
    with open(os.path.join(out, f"{name}.{rank}.json"), "w") as f:
        json.dump(record, f)


mine = [shard(b, rank) for b in global_batches()]
for name in sys.argv[3:]:
    if name.startswith("equal"):  # equal-None, equal-2
        size = name.split("-")[1]
        run(name, mine, micro_batch=None if size == "None" else int(size), epochs=2)
    elif name == "trainer":  # the script's own loop, gputui.Trainer: 2 epochs of its shards at micro-batch 2
        hubs.install(hubs.Hub())
        model = make_model()
        with gputui.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), step, micro_batch=2) as trainer:
            results = [trainer.step(b) for _ in range(2) for b in mine]
        torch.save(model.state_dict(), os.path.join(out, f"{name}.{rank}.pt"))
        with open(os.path.join(out, f"{name}.{rank}.json"), "w") as f:
            json.dump({"steps": [r.steps for r in results], "trained": [r.trained for r in results]}, f)
    elif name == "channels-last":  # the uneven last batch is news: the marked element is put back
        run(name, mine, make_model=conv_model, epochs=2)
    elif name == "uneven-lengths":  # rank 0 has 3 batches an epoch, rank 1 two: both train 2 an epoch
        run(name, mine if rank == 0 else mine[:2], epochs=2)
    elif name == "refit":  # the script keeps the DDP wrapper fit made (its step is given it) and fits it again
        import gc
        kept = []
        def keeping(model, batch, plain=step):
            kept.append(model)
            return plain(model, batch)
        plain, step = step, keeping
        run(name, mine)
        step = plain
        kept[1:] = []
        gc.collect()  # fit's own objects go: the wrapper's comm hook must not need them
        run("refit-again", mine, make_model=lambda: kept[0])
    elif name == "controls":  # asked of rank 0 alone
        def requests(hub):
            if rank == 0:
                hub.add_sink(RequestAt(hub, 1, "halve_batch"))
                hub.add_sink(RequestAt(hub, 3, "stop"))
        run(name, mine * 3, make_hub=requests)
    elif name in ("raise-in-model", "raise-in-loss"):  # rank 1's first step runs out of memory once
        calls = []
        def failing(model, batch, plain=step):
            calls.append(1)
            if rank == 1 and len(calls) == 1 and name == "raise-in-model":
                raise torch.OutOfMemoryError("out of memory (in the model)")
            loss = plain(model, batch)
            if rank == 1 and len(calls) == 1:  # DDP's synced forward has returned: it awaits the backward
                raise torch.OutOfMemoryError("out of memory (in the loss)")
            return loss
        plain, step = step, failing
        run(name, mine, calls=calls)
        step = plain
    elif name.startswith("signal-"):  # rank 1 alone gets SIGTERM / SIGINT (twice: -twice) after its step 3
        import signal
        from gputui.telemetry.hub import Sink

        class SignalAt(Sink):
            def on_sample(self, sample):
                if sample.step == 3:
                    for _ in range(2 if name.endswith("-twice") else 1):
                        os.kill(os.getpid(), getattr(signal, "SIG" + name.split("-")[1]))

        run(name, mine * 10, make_hub=lambda hub: rank == 1 and hub.add_sink(SignalAt()))
    elif name == "ctrl-c-slow":  # a Ctrl-C reaches both ranks in step 5, where rank 0 is 3 s slower
        import signal
        import time
        calls = []
        def slow(model, batch, plain=step):
            calls.append(1)
            if len(calls) == 5:
                os.kill(os.getpid(), signal.SIGINT)
                if rank == 0:
                    time.sleep(3)
            return plain(model, batch)
        plain, step = step, slow
        run(name, mine * 4)
        step = plain
    elif name.startswith("thrash-"):  # rank 1's allocator thrashes from step 1 on (retries rising every step)
        import types
        import gputui.engine.session as session
        from helpers import thrashing_allocator
        real = session.for_device
        if rank == 1:
            thrashing_allocator(types.SimpleNamespace(setattr=setattr))
        run(name, mine * 3, distributed="fsdp" if name == "thrash-fsdp" else "auto")
        session.for_device = real
    elif name.startswith("tokens-"):  # tokens-[fsdp-|samples-]SIZE: token-mean losses over padded sequences
        kind, size = name.split("-")[1:-1], name.split("-")[-1]
        plain, step = step, masked_step if "empty" in kind else token_step
        batches = token_batches(empty="last" if "empty" in kind else "rank1" if "rank1" in kind else None)
        run(name, [token_shard(b, rank) for b in batches], make_model=token_model,
            micro_batch=None if size == "None" else int(size), distributed="fsdp" if "fsdp" in kind else "auto",
            items=None if kind == ["samples"] else count_tokens)
        step = plain
    elif name.startswith("clip-"):  # clip-[fsdp-]SIZE: token means over padded sequences, their gradient clipped
        plain, step = step, token_step
        run(name, [token_shard(b, rank) for b in token_batches()], make_model=token_model, items=count_tokens,
            micro_batch=int(name.split("-")[-1]), distributed="fsdp" if "-fsdp-" in name else "auto",
            clip_grad_norm=float(os.environ["CLIP"]))
        step = plain
    elif name.startswith("fsdp-"):
        kind = name.split("-", 1)[1]
        if kind in ("None", "2"):
            run(name, mine, distributed="fsdp", micro_batch=None if kind == "None" else int(kind), epochs=2)
        elif kind == "script":
            run(name, mine, shard=True, epochs=2)
        elif kind == "prevent":  # rank 1's budget: step 1's peak comes near it, so every rank halves
            run(name, mine, distributed="fsdp", epochs=2,
                memory_budget=os.environ["FSDP_BUDGET"] if rank == 1 else None)
        elif kind == "oom":  # rank 1's budget is too small for step 1 (no peak seen yet to prevent it)
            run(name, mine, distributed="fsdp", memory_budget=os.environ["FSDP_OOM_BUDGET"] if rank == 1 else None)
    elif name == "pause":  # paused from rank 0 after step 2 for longer than the group's timeout, then resumed
        import threading

        class PauseThenResume(RequestAt):  # the pause's length counted from its request, not from the start
            def on_sample(self, sample):
                super().on_sample(sample)
                if self.seen == self.n:
                    threading.Timer(float(os.environ["PAUSE_S"]), self.hub.controls.request, ("resume",)).start()

        def pause_then_resume(hub):
            if rank == 0:
                hub.add_sink(PauseThenResume(hub, 2, "pause"))
        run(name, mine * 3, make_hub=pause_then_resume, times=True)
    elif name == "pause-plan":  # rank 0 pauses after step 2 and asks for the plan; resumed once its table came
        import threading
        from helpers import on_event

        def pause_and_plan(hub):
            if rank == 0:
                hub.add_sink(RequestAt(hub, 2, "pause"))
                on_event(hub, "paused", lambda: hub.controls.request("plan"), timeout=60)
                on_event(hub, "plan", lambda: hub.controls.request("resume"), timeout=60)
                late = threading.Timer(20, hub.controls.request, ("resume",))  # no table while paused: go on
                late.daemon = True
                late.start()
        run(name, mine * 3, make_hub=pause_and_plan)
    elif name == "unused":  # a parameter the forward uses in step 1 only, in a model fit wraps
        class Branchy(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.body, self.spare, self.calls = make_model(), torch.nn.Linear(1, 1), 0

            def forward(self, x):
                self.calls += 1
                return self.spare(self.body(x)) if self.calls == 1 else self.body(x)
        run(name, mine, make_model=Branchy)
    elif name == "bigloss":  # a diverging loss (1e13 and more) on every rank, through the exchange's float slots
        def diverging(model, batch, plain=step):
            return plain(model, batch) * 1e13
        plain, step = step, diverging
        run(name, mine, max_steps=2)
        step = plain
    elif name == "vanish":  # rank 1's process ends after its step 3 (exit status 0: torchrun waits for rank 0)
        from gputui.telemetry.hub import Sink

        class ExitAt(Sink):
            def on_sample(self, sample):
                if sample.step == 3:
                    os._exit(0)

        run(name, mine * 10, make_hub=lambda hub: rank == 1 and hub.add_sink(ExitAt()))
    elif name.startswith("oom-"):  # a memory budget on rank 1 alone: out of memory there
        size = name.split("-")[1]
        run(name, mine, micro_batch=None if size == "None" else int(size),
            memory_budget=os.environ["BUDGET"] if rank == 1 else None)
    elif name.startswith("planned-"):  # 8 samples a rank; rank 1's budget fits fewer: the planner picks
        import common
        wide = [(x[8 * rank : 8 * rank + 8], y[8 * rank : 8 * rank + 8]) for x, y in common.wide_batches()]
        run(name, wide, micro_batch="auto" if name == "planned-auto" else None,
            memory_budget=os.environ["PLANNED_BUDGET"] if rank == 1 else None)
    elif name == "order":  # what fit's own collectives are, and when, against the step's forwards
        from gputui.engine.strategies.exchange import Agreement
        log = []
        real_all_reduce, real_finish = dist.all_reduce, Agreement.finish
        def all_reduce(tensor, *args, async_op=False, **kw):
            log.append(["all_reduce", str(tensor.dtype), tensor.numel(), async_op])
            return real_all_reduce(tensor, *args, async_op=async_op, **kw)
        def finish(self):
            log.append(["wait"])
            return real_finish(self)
        def logged(model, batch, plain=step):
            log.append(["forward"])
            return plain(model, batch)
        dist.all_reduce, Agreement.finish, plain, step = all_reduce, finish, step, logged
        run(name, mine, micro_batch=2)
        steady, log = log, []
        run("quiet", mine[:2] * 40)  # 80 steps of even shards: nothing to say most steps
        dist.all_reduce, Agreement.finish, step = real_all_reduce, real_finish, plain
        with open(os.path.join(out, f"order.{rank}.log.json"), "w") as f:
            json.dump({"order": steady, "quiet": log}, f)
    elif name == "local-recover":  # rank 1's budget fits micro-batch 1, not its no_sync backward at 2
        run(name, mine, micro_batch=2, memory_budget=os.environ["LOCAL_BUDGET"] if rank == 1 else None)
    elif name.startswith(("sync-", "wrapped-sync-")):  # rank 1's budget fits its forward at 4, not its synced backward
        run(name, mine, auto_recover=name.endswith("-recover"), wrap=name.startswith("wrapped-"),
            memory_budget=os.environ["SYNC_BUDGET"] if rank == 1 else None)
    elif name == "step-error":  # step() raises on rank 1 alone, in the second step, before the model
        calls = []
        def failing(model, batch, plain=step):
            calls.append(1)
            if rank == 1 and len(calls) == 2:
                raise ValueError("bad batch")
            return plain(model, batch)
        plain, step = step, failing
        run(name, mine)
        step = plain
    elif name == "broken-step-error":  # as step-error, and gputui's undo of rank 1's step fails (a broken device)
        calls = []
        def breaking(model, batch, plain=step):
            calls.append(1)
            if rank == 1 and len(calls) == 2:
                bn = next(m for m in model.modules() if isinstance(m, torch.nn.BatchNorm1d))
                bn.running_mean.resize_(1)  # its saved copy no longer fits: putting it back fails
                raise ValueError("bad batch")
            return plain(model, batch)
        plain, step = step, breaking
        run(name, mine, make_model=bn_model)
        step = plain
    elif name.startswith("opt-oom-"):  # rank 1's optimizer.step() runs out of memory in step 1, or the last
        class Failing(torch.optim.SGD):
            calls = 0
            def step(self, closure=None):
                Failing.calls += 1
                if rank == 1 and Failing.calls == (1 if name == "opt-oom-1" else 2):
                    raise torch.OutOfMemoryError("out of memory (optimizer state)")
                return super().step(closure)
        run(name, mine, max_steps=2, optimizer=Failing)
    elif name == "trainer-opt-oom-last":  # the script's own loop: rank 1's optimizer.step() fails in its last step
        class Failing(torch.optim.SGD):
            calls = 0
            def step(self, closure=None):
                Failing.calls += 1
                if rank == 1 and Failing.calls == 2:
                    raise torch.OutOfMemoryError("out of memory (optimizer state)")
                return super().step(closure)
        hubs.install(hubs.Hub())
        model, record = make_model(), {}
        try:
            with gputui.Trainer(model, Failing(model.parameters(), lr=0.1), step) as trainer:
                for b in mine[:2]:
                    record["steps"] = trainer.step(b).steps
        except gputui.FitError as exc:
            record["error"] = str(exc)
        with open(os.path.join(out, f"{name}.{rank}.json"), "w") as f:
            json.dump(record, f)
    elif name.startswith("trainer-apart"):  # the script's own loop takes a step more on rank 1 (a quiet step)
        import time
        if name.endswith("-side"):  # the exchange on the gloo side group, as under NCCL (no quiet step)
            from gputui.engine.strategies import group, wrapper
            wrapper.exchange_group = group.side_group
        hubs.install(hubs.Hub())
        model, record, start = make_model(), {}, time.monotonic()
        try:
            with gputui.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), step, rank_timeout=120) as trainer:
                for b in (mine * 4)[: 10 + rank]:
                    record["steps"] = trainer.step(b).steps
        except gputui.FitError as exc:
            record["error"] = str(exc)
        record["seconds"] = time.monotonic() - start
        with open(os.path.join(out, f"{name}.{rank}.json"), "w") as f:
            json.dump(record, f)
    elif name == "data-error":  # rank 1's data breaks after its first batch
        def broken():
            yield mine[0]
            if rank == 1:
                raise ValueError("broken shard")
            yield from mine[1:]
        run(name, broken())
    elif name == "wrapped-bn":  # the script's own DDP, buffers synced (default); rank 1's model OOMs in step 2
        calls = []
        def hook(module, args):
            calls.append(1)
            if rank == 1 and len(calls) == 2:
                raise torch.OutOfMemoryError("out of memory (in the model)")
        run(name, mine, wrap=True, make_model=bn_model, pre_hook=hook)
if sys.argv[2] == "own-group" and dist.is_initialized():  # the script made the group: it ends it (README)
    import gc
    gc.collect()
    dist.destroy_process_group()
"""


def launch(tmp_path: Path, group: str, *scenarios: str, env: dict[str, str] | None = None) -> Path:
    (tmp_path / "common.py").write_text(COMMON)
    (tmp_path / "script.py").write_text(SCRIPT)
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    environ = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT), str(ROOT / "tests")]),
        **(env or {}),
    }
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    done = python(
        *torchrun, tmp_path / "script.py", out, group, *scenarios, env=environ, cwd=tmp_path, timeout=LAUNCH_TIMEOUT
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out


def records(out: Path, name: str) -> list[dict]:
    return [json.loads((out / f"{name}.{rank}.json").read_text()) for rank in (0, 1)]


def weights(out: Path, name: str) -> list[dict[str, torch.Tensor]]:
    return [torch.load(out / f"{name}.{rank}.pt") for rank in (0, 1)]


def reference(epochs: int, make: str = "make_model") -> dict[str, torch.Tensor]:
    """One process, the whole global batch each step, a plain loop."""
    namespace: dict = {}
    exec(COMMON, namespace)
    model = namespace[make]()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(epochs):
        for batch in namespace["global_batches"]():
            namespace["step"](model, batch).backward()
            optimizer.step()
            optimizer.zero_grad()
    return model.state_dict()


def token_reference(clip: float | None = None, empty: str | None = None) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One process, the whole global batch each step, a plain loop: the token mean over all 8 samples;
    with `clip`, its gradient clipped by clip_grad_norm_, and the norms that returned."""
    namespace: dict = {}
    exec(COMMON, namespace)
    model = namespace["token_model"]()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    norms = []
    for batch in namespace["token_batches"](empty):
        namespace["token_step"](model, batch).backward()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        optimizer.step()
        optimizer.zero_grad()
    return model.state_dict(), norms


def test_token_weighted_micro_batches_equal_one_process(tmp_path):
    """With items=, each rank's pieces are weighted by their tokens over every rank's tokens (the global
    count comes with the step's one exchange): weights equal one process's full-batch token mean at
    micro-batch None, 2 and 3 (pieces of 3 and 1), under DDP and FSDP2, also where a rank's last piece has
    no tokens. Weighted by samples, they do not."""
    good = ("tokens-None", "tokens-2", "tokens-3", "tokens-fsdp-2", "tokens-fsdp-3")
    empties = ("tokens-empty-3", "tokens-fsdp-empty-3", "tokens-rank1-3")
    out = launch(tmp_path, "fit-group", *good, "tokens-samples-2", *empties)
    expected, _ = token_reference()
    for name in good:
        for record, state in zip(records(out, name), weights(out, name), strict=True):
            assert (record["steps"], record.get("error")) == (3, None), (name, record)
            assert_close(state, expected)
    # A rank's last piece all padding (DDP's of 1 sample, FSDP2's of 2: it makes passes of equal size), its
    # loss a hand-written masked mean (0/0 over no tokens): it must run (DDP's last backward syncs, FSDP2's
    # passes are collectives), and runs at weight 0 on a piece with tokens
    for name in ("tokens-empty-3", "tokens-fsdp-empty-3"):
        for record, state in zip(records(out, name), weights(out, name), strict=True):
            assert (record["steps"], record.get("error")) == (3, None), (name, record)
            assert_close(state, token_reference(empty="last")[0])
    # Rank 1's whole share padding (cross_entropy's ignore_index: its gradient is 0, not NaN): the weights
    # are rank 0's tokens' mean, and rank 1, whose loss is a mean over nothing, is not told it is not finite
    for record, state in zip(records(out, "tokens-rank1-3"), weights(out, "tokens-rank1-3"), strict=True):
        assert (record["steps"], record.get("error")) == (3, None), record
        assert "loss_not_finite" not in [e[0] for e in record["events"]], record["events"]
        assert_close(state, token_reference(empty="rank1")[0])
    by_samples = weights(out, "tokens-samples-2")[0]
    assert max(float((by_samples[k] - expected[k]).abs().max()) for k in expected) > 1e-3
    hints = [[e for e in r["events"] if e[0] == "items_hint"] for r in records(out, "tokens-samples-2")]
    assert hints == [[["items_hint", 0, None]]] * 2


def test_the_clip_is_the_whole_models_gradient_under_ddp_and_fsdp2(tmp_path):
    """clip_grad_norm under torchrun: DDP's reduced gradient and FSDP2's shards (their norms combined over
    the ranks) are clipped as one process clips the whole batch's; every rank records the same norms."""
    names = ("clip-2", "clip-fsdp-2")
    out = launch(tmp_path, "fit-group", *names, env={"CLIP": "0.44"})
    expected, norms = token_reference(clip=0.44)
    assert sum(n > 0.44 for n in norms) >= 2, "the clip must bite for this test to mean anything"
    for name in names:
        for record, state in zip(records(out, name), weights(out, name), strict=True):
            assert (record["steps"], record.get("error")) == (3, None), (name, record)
            assert record["norms"] == pytest.approx(norms, rel=1e-5), name
            assert_close(state, expected)


def assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=1e-5, rtol=1e-4)


def test_ddp_equals_one_process_and_controls_agree(tmp_path):
    """fit initialises the group itself here. Weights equal the single-process reference (uneven
    last batch, micro-batch None and 2; through gputui.Trainer; a channels_last model, whose gradients
    DDP's buckets hold in that layout); uneven data lengths end each
    epoch on every rank at the shortest; a halve and a stop sent to rank 0 alone are applied by both
    at the same step."""
    names = ("equal-None", "equal-2", "uneven-lengths", "controls", "refit", "trainer", "channels-last")
    out = launch(tmp_path, "fit-group", *names)
    expected = reference(epochs=2)
    # A model in channels_last: the element the marker took is put back where the bucket had it.
    for record, state in zip(records(out, "channels-last"), weights(out, "channels-last"), strict=True):
        assert (record["steps"], record.get("error")) == (6, None), record
        assert_close(state, reference(epochs=2, make="conv_model"))
    # The script's own loop (gputui.Trainer) trains the same, each rank's step counted alike.
    for record, state in zip(records(out, "trainer"), weights(out, "trainer"), strict=True):
        assert (record["steps"], all(record["trained"])) == ([1, 2, 3, 4, 5, 6], True), record
        assert_close(state, expected)
    for name in ("equal-None", "equal-2"):
        for rank, (record, state) in enumerate(zip(records(out, name), weights(out, name), strict=True)):
            assert (record["rank"], record["world_size"], record["steps"], record["epochs"]) == (rank, 2, 6, 2)
            assert record["ddp_alive"] == 0
            assert_close(state, expected)
    # A wrapper fit made and the script kept trains again once fit's own objects are gone.
    assert [(r["steps"], r.get("error")) for r in records(out, "refit-again")] == [(3, None), (3, None)]
    # Each rank's run says where it is in the job, the job's id the same on both (what `gputui jobs` groups by).
    ids = [r["identity"] for r in records(out, "equal-None")]
    assert [i[:4] for i in ids] == [[0, 2, 0, 0], [1, 2, 1, 0]] and ids[0][4] == ids[1][4] != ""
    # Every rank's sample says every rank's micro-batch (the last step's: 4 and 2 samples) and, one step
    # late, its peak (no capacity: no memory budget); the same on both.
    a, b = (r["ranks"] for r in records(out, "equal-None"))
    assert a == b
    assert [(r["rank"], r["micro_batch"], r["capacity"]) for r in a] == [(0, 4, None), (1, 2, None)]
    assert all(r["peak"] > 0 for r in a)

    for record in records(out, "uneven-lengths"):
        assert (record["steps"], record["epochs"], record.get("error")) == (4, 2, None)
    a, b = weights(out, "uneven-lengths")
    assert_close(a, b)

    # Asked on rank 0 after step 1 (halve) and step 3 (stop): said at the next step's exchange, applied
    # by both at the boundary after it. Rank 1's third batch has 2 samples: the halve acts on the job's
    # micro-batch (the largest rank's, 4), so both go to 2, and neither realigns afterwards.
    both = records(out, "controls")
    for record in both:
        assert [e for e in record["events"] if e[0] == "micro_batch_changed"] == [["micro_batch_changed", 2, 2]]
    for record in both:
        assert (record["stopped"], record["steps"]) == ("requested", 4)
    a, b = weights(out, "controls")
    assert_close(a, b)


def test_a_signal_to_one_rank_stops_every_rank_at_the_same_step(tmp_path):
    """SIGTERM (a scheduler's) or SIGINT (a Ctrl-C) reaching rank 1 alone, after its step 3: said at
    step 4's exchange, so both ranks finish step 4 and stop there, with the same weights. A Ctrl-C
    reaches a rank twice under torchrun (the terminal's, then torchrun's): still one graceful stop,
    and one that reaches every rank while one is slow inside its step too. A rank whose process ends
    mid-run leaves the other with a FitError that says so (it goes last: rank 1 is gone after it)."""
    names = ("signal-TERM", "signal-INT", "signal-INT-twice", "ctrl-c-slow", "unused", "bigloss", "vanish")
    out = launch(tmp_path, "fit-group", *names)
    stops = (("signal-TERM", "terminated"), ("signal-INT", "interrupted"), ("signal-INT-twice", "interrupted"))
    for name, reason in stops:
        for record in records(out, name):
            assert (record["stopped"], record["steps"], record.get("error")) == (reason, 4, None), name
        a, b = weights(out, name)
        assert_close(a, b)
    # A Ctrl-C reaching every rank while one is seconds behind in its step: rank 1, waiting for rank 0 in
    # the synced backward, waits it out (rank 0 is alive) and both stop together after step 5.
    for record in records(out, "ctrl-c-slow"):
        assert (record["stopped"], record["steps"], record.get("error")) == ("interrupted", 5, None), record
    # A rank gone without a word: the others say so in a FitError, not with gloo's traceback.
    survivor = json.loads((out / "vanish.0.json").read_text())
    assert survivor["error"].startswith("rank 0 lost the other ranks"), survivor
    assert not (out / "vanish.1.json").exists()
    # A loss past what int64 millionths could hold travels as a float64's bits: exact, no crash.
    for record in records(out, "bigloss"):
        assert (record["steps"], record.get("error")) == (2, None), record
        assert all(r["loss"] > 1e12 for r in record["ranks"]), record["ranks"]
    # DDP's own advice names a constructor the user never called: the error says what to do instead.
    for record in records(out, "unused"):
        assert (
            "wrap it yourself before fit, DistributedDataParallel(model, find_unused_parameters=True)"
            in (record["error"])
        ), record


def test_a_failing_rank_ends_every_rank(tmp_path):
    """Rank 1 alone runs out of memory even at micro-batch 1 (after halving alone from 4, or from the
    start), step() raises there before calling the model (in step 2, whose first forward DDP would
    rebuild its buckets in: fit has done it already), its optimizer.step() runs out of memory (in
    step 1, or in the last step, said at the closing exchange), or its data breaks: both ranks
    raise FitError at the same step, each saying why, and nothing hangs."""
    scenarios = (
        *("oom-None", "oom-1", "step-error", "broken-step-error", "opt-oom-1", "opt-oom-last"),
        *("trainer-opt-oom-last", "data-error"),
    )
    out = launch(tmp_path, "own-group", *scenarios, env={"BUDGET": "584B"})
    for name in scenarios:
        both = records(out, name)
        assert all("error" in r for r in both), (name, both)
        assert both[0]["steps"] == both[1]["steps"], name
        assert both[0]["error"].startswith("rank 1 stopped "), both[0]["error"]
        assert "lost the other ranks" not in both[1]["error"], both[1]["error"]
    for name in ("oom-None", "oom-1"):
        error = records(out, name)[1]["error"]
        assert error.startswith("rank 1, step 1: out of memory in backward at micro-batch 1: not even one sample fits")
    assert [e[3] for e in records(out, "oom-None")[1]["ooms"]] == [2, 1, None], "halved alone twice, then gave up"
    assert "ValueError on rank 1, step 2: bad batch" in records(out, "step-error")[1]["error"]
    assert records(out, "step-error")[0]["steps"] == 1
    # Rank 1's undo fails too (as on a device its error broke): still gputui's FitError, the undo a note under it
    broken = records(out, "broken-step-error")
    assert [r["steps"] for r in broken] == [1, 1], broken
    assert "ValueError on rank 1, step 2: bad batch" in broken[1]["error"]
    if sys.version_info >= (3, 11):
        assert broken[1]["notes"], broken[1]
        assert all(n.startswith("gputui could not undo the failed step (RuntimeError: ") for n in broken[1]["notes"])
        assert broken[0]["notes"] == [], "rank 0 undid its step"
    for name, steps, said in (
        ("opt-oom-1", 1, "at step 2"),
        ("opt-oom-last", 2, "after step 2"),
        ("trainer-opt-oom-last", 2, "after step 2"),  # the script's own loop: its closing exchange says it
    ):
        both = records(out, name)
        assert [r.get("steps") for r in both] == [steps] * 2, both
        assert both[1]["error"].startswith(f"out of memory inside optimizer.step() on rank 1 at step {steps}")
        assert both[0]["error"].startswith(f"rank 1 stopped {said} (out of memory)"), both[0]["error"]
    error = records(out, "data-error")[1]["error"]
    assert error.startswith("ValueError on rank 1 reading the data: broken shard"), error


def test_single_process_is_unchanged():
    """distributed="auto" without torchrun: no wrapper, rank 0 of 1."""
    namespace: dict = {}
    exec(COMMON, namespace)
    import gputui

    model = namespace["make_model"]()
    result = gputui.fit(model, namespace["global_batches"](), namespace["step"], torch.optim.SGD(model.parameters()))
    assert (result.rank, result.world_size, result.steps) == (0, 1, 3)
    assert type(model) is nn.Sequential


def test_ooms_on_one_rank_are_recovered_without_a_hang(tmp_path):
    """Rank 1 alone runs out of memory, and every run ends equal to the one-process reference:
    - in the model's forward, or in a no_sync backward (its budget fits micro-batch 1, not 2):
      before its first gradient collective of the step, so it replays its share alone at half the
      micro-batch while rank 0 waits in the synced backward (rank 0 runs step() once a micro-batch);
    - in the loss, after DDP's synced forward returned (DDP awaits that backward), or in the synced
      backward (its budget fits the forward at 4): rank 1 completes the gradient buckets with
      zeros, the step is agreed invalid and both replay it (rank 1 at half its micro-batch). The
      verdict rides on DDP's last bucket where fit wrapped the model, and takes an all_reduce of its
      own where the script did (wrapped-sync-recover).
    Without auto-recover the synced backward's OOM ends both at the same step. Nothing waits for
    the process group's timeout."""
    scenarios = (
        "raise-in-model",
        "local-recover",
        "raise-in-loss",
        "sync-recover",
        "wrapped-sync-recover",
        "sync-fatal",
        "wrapped-bn",
    )
    out = launch(tmp_path, "own-group", *scenarios, env={"LOCAL_BUDGET": "860B", "SYNC_BUDGET": "960B"})
    expected = reference(epochs=1)
    ooms = {"raise-in-model": ("forward", 2), "local-recover": ("backward", 1), "raise-in-loss": ("forward", 2)}
    ooms["sync-recover"] = ooms["wrapped-sync-recover"] = ("backward", 2)
    for name, (phase, to) in ooms.items():
        both = records(out, name)
        for record, state in zip(both, weights(out, name), strict=True):
            assert (record["steps"], record.get("error")) == (3, None), name
            assert_close(state, expected)
        assert both[1]["ooms"] == [["oom_recovered", 0, phase, to]], name
        assert both[0]["ooms"] == [], name
        # Rank 0's screen hears of rank 1's OOM, once: at the first exchange where rank 1 says it had one.
        assert [e[0] for e in both[0]["events"] if e[0] == "rank_oom_recovered"] == ["rank_oom_recovered"], name
    # step() calls: rank 1 fails once, then trains at micro-batch 2 (2 + 2 + 1 pieces). Rank 0 trains
    # its first two batches whole where rank 1 recovered alone: rank 1 says its micro-batch at step 2's
    # exchange (step 1's went out as the step began), so rank 0 aligns from step 3 on (2 pieces); where
    # rank 1's failure came after DDP's forward, both replay step 1 (rank 0 whole, again) with an
    # exchange of its own, so rank 0 aligns from step 2 on (2 + 2 pieces).
    assert [r["calls"] for r in records(out, "raise-in-model")] == [4, 6]
    assert [r["calls"] for r in records(out, "raise-in-loss")] == [6, 6]
    aligned = [e for e in records(out, "raise-in-model")[0]["events"] if e[0] == "micro_batch_changed"]
    assert aligned == [["micro_batch_changed", 2, 2]], "rank 0 aligned with rank 1 a step later"

    # The script's DDP with BatchNorm and its buffer sync on: rank 1 replays step 2 alone; its DDP forward
    # does not broadcast the buffers a second time (fit broadcasts them once a step, after the backward).
    bn = records(out, "wrapped-bn")
    assert [(r["steps"], r.get("error")) for r in bn] == [(3, None), (3, None)]
    assert bn[1]["ooms"] == [["oom_recovered", 1, "forward", 2]]
    a, b = weights(out, "wrapped-bn")
    assert_close(a, b)

    fatal = records(out, "sync-fatal")
    assert [r["steps"] for r in fatal] == [0, 0]
    assert fatal[0]["error"].startswith("rank 1 stopped at step 1 (said in the synced backward)")
    assert "in the synced backward at micro-batch 4 on rank 1, step 1" in fatal[1]["error"]


def test_the_planners_pick_is_agreed_after_an_oom_and_with_auto(tmp_path):
    """Rank 1's budget fits 5 of its 8 samples: after its OOM it retries at the planner's pick for its
    share (5, not half), and rank 0 takes it at the next boundary (the smallest pick any rank made);
    with micro_batch="auto" each rank picks at start (rank 0, unbounded, its whole share) and both
    run rank 1's from the next boundary. The weights equal one process's on the global batches."""
    out = launch(tmp_path, "fit-group", "planned-None", "planned-auto", env={"PLANNED_BUDGET": "1140B"})
    namespace: dict = {}
    exec(COMMON, namespace)
    model = namespace["make_model"]()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in namespace["wide_batches"]():
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    expected = model.state_dict()
    for name in ("planned-None", "planned-auto"):
        for record, state in zip(records(out, name), weights(out, name), strict=True):
            assert (record["steps"], record.get("error")) == (2, None), (name, record)
            assert_close(state, expected)
    planned = records(out, "planned-None")
    assert [o[3] for o in planned[1]["ooms"]] == [5], planned[1]["ooms"]
    assert planned[0]["ooms"] == []
    changed = [e for e in planned[0]["events"] if e[0] == "micro_batch_changed"]
    assert changed == [["micro_batch_changed", 1, 5]], "rank 0 took rank 1's pick at the next boundary"
    auto = records(out, "planned-auto")
    assert auto[1]["ooms"] == [] and [e for e in auto[1]["events"] if e[0] == "micro_batch_changed"] == [
        ["micro_batch_changed", 0, 5]
    ]
    assert [e for e in auto[0]["events"] if e[0] == "micro_batch_changed"] == [
        ["micro_batch_changed", 0, 8],
        ["micro_batch_changed", 1, 5],
    ]


def test_a_step_meets_the_others_only_in_ddps_all_reduce(tmp_path):
    """The run's first step exchanges asynchronously, started before its first forward and waited for
    after its last. After it a step adds no collective of its own while no rank has anything to say:
    some rank's news (here rank 1's last batch, smaller, and the rows due at first) marks DDP's last
    bucket, and the exchange comes after that bucket's all-reduce (the synced backward), waited for
    at once. 80 steps with nothing to say exchange a handful of times, not 80. No all_reduce of fit's
    blocks."""
    out = launch(tmp_path, "fit-group", "order")
    for rank in (0, 1):
        logs = json.loads((out / f"order.{rank}.log.json").read_text())
        log = logs["order"]
        assert not [c for c in log if c[0] == "all_reduce" and not c[3]], "a blocking all_reduce"
        exchanges = [i for i, c in enumerate(log) if c[0] == "all_reduce" and c[1] == "torch.int64"]
        forwards = [i for i, c in enumerate(log) if c[0] == "forward"]
        assert len(forwards) == 6 - rank, log  # 3 steps of 2 micro-batches (rank 1's last batch: 1 sample, one)
        first = exchanges[0]
        assert first < forwards[0] and log[first + 1 : forwards[1] + 2] == [["forward"], ["forward"], ["wait"]], log
        for i in exchanges[1:]:  # after a step's last bucket went out, or the closing one
            assert log[i - 1][:2] == ["all_reduce", "torch.float32"] or i > forwards[-1], log
            assert log[i + 1] == ["wait"], log
        assert exchanges[-1] > forwards[-1] and log[-2:] == [log[exchanges[-1]], ["wait"]], "the closing exchange"
        quiet = logs["quiet"]
        steps = sum(c == ["forward"] for c in quiet)
        said = sum(c[0] == "all_reduce" and c[1] == "torch.int64" for c in quiet)
        assert steps == 80 and said <= 10, (steps, said)
        assert not [c for c in quiet if c[0] == "all_reduce" and not c[3]], "a blocking all_reduce"


def test_a_pause_longer_than_the_group_timeout_holds_every_rank(tmp_path):
    """A pause asked of rank 0 alone pauses both at the same boundary; they exchange a heartbeat a
    second while paused, so a pause of 9 s outlives a process group whose timeout is 5 s; the resume
    (from rank 0) resumes both at the same boundary and training ends on both."""
    out = launch(tmp_path, "own-group", "pause", env={"PG_TIMEOUT": "5", "PAUSE_S": "9"})
    both = records(out, "pause")
    for record in both:
        assert (record["steps"], record.get("error")) == (9, None), record
        pause = {e[0]: e for e in record["events"] if e[0] in ("paused", "resumed")}
        assert (pause["paused"][1], pause["resumed"][1]) == (3, 3), record["events"]
        assert pause["resumed"][3] - pause["paused"][3] > 6  # past the timeout: heartbeats held it
    a, b = weights(out, "pause")
    assert_close(a, b)


def test_a_plan_asked_while_paused_is_made_on_every_rank_before_the_resume(tmp_path):
    """The plan control reaches both ranks through the paused ranks' heartbeat exchange, and each makes its
    table there, as one process does, not after the resume."""
    out = launch(tmp_path, "own-group", "pause-plan")
    for record in records(out, "pause-plan"):
        names = [e[0] for e in record["events"]]
        assert (record["steps"], record.get("error")) == (9, None), record
        assert "plan" in names and names.index("paused") < names.index("plan") < names.index("resumed"), names
        assert "control_refused" not in names and "error" not in names, record["events"]


def test_a_trainer_loop_longer_on_one_rank_is_said_on_both_in_seconds(tmp_path):
    """Rank 1's own loop takes an 11th step where rank 0's ended at 10: its synced backward must not meet
    rank 0's closing exchange (under gloo a collective mismatch aborted the process), and neither rank
    waits for `rank_timeout` (120 s here): each says what happened, and the fix."""
    fix = "every rank's loop must take as many steps"
    # -side: the exchange on the closing exchange's group, as under NCCL: the two exchanges meet, and its slots say it
    for name in ("trainer-apart", "trainer-apart-side"):  # a job each: the first leaves collectives abandoned
        (tmp_path / name).mkdir()
        short, long = records(launch(tmp_path / name, "fit-group", name), name)
        assert short["error"] == f"rank 1 went on to step 11 after rank 0's loop ended at step 10: {fix}" + SAMPLER
        assert long["error"] == f"rank 0's loop ended at step 10 while rank 1's went on to step 11: {fix}" + SAMPLER
        assert short["steps"] == long["steps"] == 10
        assert short["seconds"] < 60 and long["seconds"] < 60, (short, long)


SAMPLER = " (a DistributedSampler gives each rank as many batches)"


def test_fsdp2_equals_one_process_and_prevents_ooms(tmp_path):
    """distributed="fsdp" shards the model (and points the optimizer at the shards); a model the script
    sharded is used as is. Every rank runs as many passes as the one that needs the most (the uneven
    last batch: rank 1 splits its 2 samples, or repeats a piece at weight 0): weights equal the
    one-process reference at micro-batch None and 2. When rank 1's step peak comes within 10 % of its
    budget, every rank halves at the same step, and no OOM comes. An OOM that still comes (step 1,
    no peak seen yet) ends both ranks with a FitError, rank 1 saying why, nothing waiting for the
    process group's timeout (it goes last: fit's group is gone after it)."""
    scenarios = ("fsdp-None", "fsdp-2", "fsdp-script", "fsdp-prevent", "thrash-ddp", "thrash-fsdp", "fsdp-oom")
    out = launch(tmp_path, "fit-group", *scenarios, env={"FSDP_BUDGET": "1260B", "FSDP_OOM_BUDGET": "1060B"})
    expected = reference(epochs=2)
    for name in scenarios[:4]:
        for record, state in zip(records(out, name), weights(out, name), strict=True):
            assert (record["steps"], record["epochs"], record.get("error")) == (6, 2, None), (name, record)
            assert_close(state, expected)
    prevent = records(out, "fsdp-prevent")
    halved = [[e for e in r["events"] if e[0] == "micro_batch_changed"] for r in prevent]
    assert halved[0] == halved[1] == [["micro_batch_changed", 2, 2]], halved  # step 1's peak, said at step 2
    assert prevent[0]["ooms"] == prevent[1]["ooms"] == []
    # Rank 1's allocator thrashes: said at the exchange, every rank halves at the same step (DDP and FSDP
    # alike; a rank halving alone would run other passes than the others under FSDP, and hang).
    for name in ("thrash-ddp", "thrash-fsdp"):
        both = records(out, name)
        halved = [[e for e in r["events"] if e[0] == "micro_batch_changed"] for r in both]
        assert halved[0] == halved[1] and halved[0] and halved[0][0][2] == 2, (name, halved)
        assert [(r["steps"], r.get("error")) for r in both] == [(9, None), (9, None)], name
        a, b = weights(out, name)
        assert_close(a, b)
    oom = records(out, "fsdp-oom")
    assert oom[1]["error"].startswith("out of memory in backward at micro-batch 4 on rank 1, step 1, under FSDP")
    assert "lost the other ranks" in oom[0]["error"] or "under FSDP" in oom[0]["error"], oom[0]["error"]


def test_the_tui_is_refused_under_torchrun(tmp_path):
    """Every rank would draw its own screen on one terminal: `gputui run` says to use --headless."""
    script = tmp_path / "train.py"
    script.write_text("print('trained')\n")
    env = {**os.environ, "WORLD_SIZE": "2", "RANK": "1", "PYTHONPATH": str(ROOT)}
    done = gputui("run", script, env=env)
    assert done.returncode == 2
    assert done.stderr.startswith("gputui: error: under torchrun every rank would draw its TUI"), done.stderr
    assert "trained" not in done.stdout
