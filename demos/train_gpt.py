"""Demo: a real training script on gputui.Trainer: the loop is the script's, the step is gputui's.

A byte-level GPT (demos/gpt.py's model) learns Python's own reference documentation (pydoc_data,
shipped with Python: nothing downloaded) from padded variable-length sequences, shaped like the
scripts people train with (nanoGPT's train.py): warmup + cosine learning rate, gradient clipping,
an evaluation on held-out text every --eval-interval steps, a log line every --log-interval steps, a
checkpoint every --save-interval steps and when the run ends or is stopped (q, Ctrl-C), --resume.

python demos/train_gpt.py                      # about a minute on a CPU
gputui run demos/train_gpt.py                  # the same, on the screen; q stops it after a step, saved
gputui run demos/train_gpt.py --resume         # goes on from out/ckpt.pt to --steps
gputui run --memory-budget 24MiB demos/train_gpt.py   # OOMs recovered mid-run, the loop none the wiser
"""

from __future__ import annotations

import argparse
import math
import os
import re
import time

import torch
from gpt import GPT
from torch.nn import functional as F

import gputui

VOCAB = 256  # bytes
PAD = 0  # a byte the text never holds; its labels are -100, so no loss is taken on it


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=600, help="optimizer steps in all, a resumed run's included")
    p.add_argument("--batch", type=int, default=32, help="sequences per global batch")
    p.add_argument("--micro-batch", type=int, default=None, help="start with this micro-batch (default: whole)")
    p.add_argument("--amp", default="off", choices=["off", "bf16", "fp16", "auto"], help="mixed precision")
    p.add_argument("--device", default=None, help="cuda, cuda:1, mps or cpu (default: the best there is)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (the floor is a tenth)")
    p.add_argument("--warmup", type=int, default=None, help="warmup steps (default: 5%% of --steps)")
    p.add_argument("--grad-clip", type=float, default=1.0, help="clip the gradients' total norm to this (0: never)")
    p.add_argument("--eval-interval", type=int, default=100, help="evaluate every this many steps")
    p.add_argument("--eval-batches", type=int, default=None, help="held-out batches per evaluation (default: all)")
    p.add_argument("--log-interval", type=int, default=20, help="a log line every this many steps")
    p.add_argument("--save-interval", type=int, default=200, help="a checkpoint every this many steps")
    p.add_argument(
        "--patience", type=int, default=0, help="stop after this many evaluations without a better val loss (0: never)"
    )
    p.add_argument("--out", default="out", help="the checkpoint's folder (OUT/ckpt.pt)")
    p.add_argument("--resume", action="store_true", help="go on from OUT/ckpt.pt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--width", type=int, default=96)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=64, help="the longest sequence, in bytes")
    args = p.parse_args(argv)
    for name in ("steps", "batch", "eval_interval", "eval_batches", "log_interval", "save_interval", "seq"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.width % args.heads:
        p.error(f"--width ({args.width}) must be a multiple of --heads ({args.heads})")
    return args


# -- data ---------------------------------------------------------------------------------------
def sequences(seq: int) -> tuple[list[bytes], list[bytes]]:
    """(train, val): the paragraphs of Python's reference documentation cut into pieces of at most
    `seq` bytes, every tenth paragraph held out. Short paragraphs and the ends of long ones make the
    lengths vary: about a third are shorter than `seq`."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[name] for name in sorted(topics))
    paragraphs = [p.strip().encode() for p in re.split(r"\n\s*\n", text) if p.strip()]
    train: list[bytes] = []
    val: list[bytes] = []
    for i, paragraph in enumerate(paragraphs):
        pieces = [paragraph[j : j + seq] for j in range(0, len(paragraph), seq)]
        (val if i % 10 == 0 else train).extend(p for p in pieces if len(p) > 1)  # one byte predicts nothing
    return train, val


def collate(pieces: list[bytes]) -> dict[str, torch.Tensor]:
    """Pad to the longest piece (rounded up to 8, as Hugging Face's collators do), labels -100 on padding."""
    width = -(-max(len(p) for p in pieces) // 8) * 8
    ids = torch.full((len(pieces), width), PAD, dtype=torch.long)
    for row, piece in enumerate(pieces):
        ids[row, : len(piece)] = torch.tensor(list(piece))
    labels = ids.masked_fill(ids == PAD, -100)
    return {"input_ids": ids, "labels": labels}


def train_batch(train: list[bytes], batch: int, step: int, seed: int) -> dict[str, torch.Tensor]:
    """Step `step`'s batch: drawn from a generator seeded by the step, so a resumed run trains on the
    batches the stopped one would have."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return collate([train[int(i)] for i in torch.randint(len(train), (batch,), generator=g)])


# -- the model's loss, what it is a mean over, the schedule ---------------------------------------
def loss_fn(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Next-byte cross-entropy, the mean over the labels that count (shifted, as a causal LM's)."""
    logits = model(batch["input_ids"])
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(), ignore_index=-100)


def items(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """What loss_fn's mean is over: the shifted labels that are not padding."""
    return (batch["labels"][:, 1:] != -100).sum()


def lr_factor(step: int, warmup: int, total: int, floor: float = 0.1) -> float:
    """The learning rate's multiple at `step`: linear warmup, then a cosine down to `floor`."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


# -- the script ---------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    path = os.path.join(args.out, "ckpt.pt")
    if args.resume and not os.path.exists(path):
        raise SystemExit(f"--resume: no checkpoint at {path} (--out names the folder a run saved to)")
    checkpoint = torch.load(path, map_location="cpu", weights_only=True) if args.resume else None
    # A resumed run keeps the model it saved, whatever the size flags say.
    shape = checkpoint["model_args"] if checkpoint else dict(width=args.width, layers=args.layers, heads=args.heads)
    seq = checkpoint["model_args"]["seq"] if checkpoint else args.seq
    torch.manual_seed(args.seed)
    train, val = sequences(seq)
    val = val[: args.batch * args.eval_batches] if args.eval_batches else val
    val_batches = [collate(val[i : i + args.batch]) for i in range(0, len(val), args.batch)]

    model = GPT(VOCAB, shape["width"], shape["layers"], shape["heads"], seq)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = args.warmup if args.warmup is not None else max(1, args.steps // 20)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, warmup, args.steps))
    print(
        f"GPT {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params; {len(train)} train and "
        f"{len(val)} val sequences of at most {seq} bytes"
    )

    with gputui.Trainer(
        model,
        optimizer,
        loss_fn,
        steps=args.steps,  # the whole run's, so the screen's "step N/M" and ETA hold after a resume
        scheduler=scheduler,  # stepped once per trained step; a batch replayed after an OOM is one step
        micro_batch=args.micro_batch,
        amp=args.amp,
        device=args.device,
        items=items,
        clip_grad_norm=args.grad_clip or None,
    ) as trainer:
        step, best, stale = 0, math.inf, 0
        if checkpoint:  # after the Trainer moved the model: the optimizer's state lands on its device
            model.load_state_dict(checkpoint["model"])
            optimizer.load_state_dict(checkpoint["optimizer"])
            scheduler.load_state_dict(checkpoint["scheduler"])
            trainer.load_state_dict(checkpoint["trainer"])  # the micro-batch, AMP... the run had found
            step, best, stale = checkpoint["step"], checkpoint["best_val_loss"], checkpoint["stale_evals"]
            print(f"resumed from {path} at step {step}")

        def save() -> None:
            os.makedirs(args.out, exist_ok=True)
            gputui.save(
                {
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(),
                    "trainer": trainer.state_dict(),
                    "step": step,
                    "best_val_loss": best,
                    "stale_evals": stale,
                    "model_args": dict(shape, seq=seq),
                },
                path,
            )
            print(f"step {step}: saved {path}")

        saved, started, since = step, time.perf_counter(), step
        while step < args.steps:
            lr = optimizer.param_groups[0]["lr"]  # this step's: gputui steps the scheduler after it
            result = trainer.step(train_batch(train, args.batch, step, args.seed))
            step = result.steps
            if result.stopped:  # q, Ctrl-C or SIGTERM: the step in progress finished; save and leave
                print(f"step {step}: stopping ({result.stopped})")
                break
            if step % args.log_interval == 0:  # reading the loss waits for the device: only here
                ms = (time.perf_counter() - started) * 1000 / (step - since)
                print(
                    f"step {step}/{args.steps}: loss {result.loss:.4f}, grad norm {result.grad_norm:.3f}, "
                    f"lr {lr:.2e}, micro-batch {result.micro_batch}, {ms:.0f} ms/step"
                )
            if step % args.eval_interval == 0 or step == args.steps:
                val_loss = gputui.evaluate(model, val_batches, loss_fn, items=items, micro_batch=result.micro_batch)
                stale = 0 if val_loss < best else stale + 1
                best = min(best, val_loss)
                print(f"step {step}: val loss {val_loss:.4f} (best {best:.4f})")
                if args.patience and stale >= args.patience:
                    print(f"step {step}: no better val loss in {stale} evaluations, stopping early")
                    break
            if step % args.save_interval == 0:
                save()
                saved = step
            if step % args.log_interval == 0:
                started, since = time.perf_counter(), step  # the next ms/step leaves evaluation and saving out
        if step != saved:
            save()
    print(f"done: {step} steps, best val loss {best:.4f}" if best < math.inf else f"done: {step} steps, not evaluated")


if __name__ == "__main__":
    main()
