"""Flags both demos share: how long to train and which remedies to start with."""

from __future__ import annotations

import argparse
import os

import gputui


def parser(description: str, *, steps: int, batch: int) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--steps", type=int, default=steps, help=f"optimizer steps (default {steps})")
    p.add_argument("--epochs", type=int, default=None, help="passes over the data (default: as --steps needs)")
    p.add_argument("--batch", type=int, default=batch, help=f"global batch size (default {batch})")
    p.add_argument(
        "--micro-batch", type=int, default=None, help="start with this micro-batch (default: the whole batch)"
    )
    p.add_argument("--device", default=None, help="cuda, cuda:1, mps or cpu (default: the best there is)")
    p.add_argument("--amp", default="off", choices=["off", "bf16", "fp16", "auto"], help="mixed precision")
    p.add_argument("--checkpointing", action="store_true", help="start with activation checkpointing on")
    p.add_argument("--memory-budget", default=None, help="act as if the device had only this much (e.g. 64MiB)")
    p.add_argument("--manual", action="store_true", help="on OOM, pause and wait instead of halving the micro-batch")
    p.add_argument("--lr", type=float, default=3e-3, help="learning rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--metrics", default=None, help="write JSON lines to this file")
    p.add_argument("--save", default=None, metavar="PATH", help="save the model here when training ends or is stopped")
    p.add_argument("--fsdp", action="store_true", help="under torchrun, shard the model with FSDP2 (default: DDP)")
    return p


def world() -> tuple[int, int]:
    """(this process's rank, the number of ranks): (0, 1) unless torchrun launched several. Each rank
    trains its share of every global batch (--batch is the global batch)."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def apply_size(args: argparse.Namespace, sizes: dict[str, tuple[int, ...]], names: tuple[str, ...]) -> None:
    """Fill the size flags left unset from the preset: small on a CPU, large where CUDA is."""
    import torch

    size = args.size or ("large" if torch.cuda.is_available() and args.device in (None, "cuda") else "small")
    for name, value in zip(names, sizes[size], strict=True):
        if getattr(args, name) is None:
            setattr(args, name, value)


def fit_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        epochs=args.epochs,
        max_steps=args.steps,
        micro_batch=args.micro_batch,
        device=args.device,
        amp=args.amp,
        checkpointing=args.checkpointing,
        memory_budget=args.memory_budget,
        auto_recover=not args.manual,
        metrics=args.metrics,
        distributed="fsdp" if args.fsdp else "auto",
    )


def finish(model, result: gputui.FitResult, args: argparse.Namespace) -> None:
    if args.save and result.rank == 0:  # under torchrun every rank holds the same weights
        gputui.save(model.state_dict(), args.save)
        print(f"saved the model to {args.save} after step {result.steps}")
