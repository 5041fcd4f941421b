"""Demo: a small GPT-style language model on synthetic tokens from a random Markov chain.

python demos/gpt.py                        # small: about a minute on a CPU (q stops it sooner)
python demos/gpt.py --steps 200            # a quick run
python demos/gpt.py --width 768 --layers 12 --seq 1024 --batch 32   # big enough to hurt a GPU
torchrun --nproc-per-node 2 demos/gpt.py --fsdp   # two ranks, the model sharded (FSDP2); DDP without --fsdp
"""

from __future__ import annotations

import math
from collections import OrderedDict

import common
import torch
from torch import nn
from torch.nn import functional as F

import gputui


class Attention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attn = Attention(width, heads)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            OrderedDict(fc1=nn.Linear(width, 4 * width), act=nn.GELU(), fc2=nn.Linear(4 * width, width))
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, width: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(seq, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tokens.weight
        self.apply(self._init)

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tokens(idx) + self.positions(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def step(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(batch["input"])
    return F.cross_entropy(logits.flatten(0, 1), batch["target"].flatten())


# width, layers, heads, sequence length
SIZES = {"tiny": (32, 2, 2, 16), "small": (96, 4, 4, 32), "large": (768, 12, 12, 512)}


class MarkovTokens:
    """Batches of token sequences from a random sparse Markov chain: learnable, nothing downloaded."""

    def __init__(self, vocab: int, seq: int, batch: int, steps: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        # each token can be followed by 4 others: the best loss is about ln(4) = 1.39
        self.next = torch.randint(vocab, (vocab, 4), generator=g)
        rank, world = common.world()  # under torchrun, each rank draws its own share of each batch
        self.vocab, self.seq, self.batch, self.steps, self.seed = vocab, seq, batch // world, steps, seed + rank

    def __len__(self) -> int:
        return self.steps

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed + 1)
        for _ in range(self.steps):
            tokens = torch.empty(self.batch, self.seq + 1, dtype=torch.long)
            tokens[:, 0] = torch.randint(self.vocab, (self.batch,), generator=g)
            choice = torch.randint(4, (self.batch, self.seq), generator=g)
            for i in range(self.seq):
                tokens[:, i + 1] = self.next[tokens[:, i], choice[:, i]]
            yield {"input": tokens[:, :-1], "target": tokens[:, 1:]}


def main() -> None:
    # 1500 steps: about a minute on a CPU, long enough to press the keys and watch them act.
    p = common.parser(__doc__.splitlines()[0], steps=1500, batch=32)
    p.add_argument(
        "--size",
        choices=sorted(SIZES),
        default=None,
        help="a preset for the four flags below (default: small on a CPU, large on a GPU)",
    )
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--heads", type=int, default=None)
    p.add_argument("--seq", type=int, default=None)
    args = p.parse_args()
    common.apply_size(args, SIZES, ("width", "layers", "heads", "seq"))
    if args.width % args.heads:
        p.error(f"--width ({args.width}) must be a multiple of --heads ({args.heads})")

    torch.manual_seed(args.seed)
    data = MarkovTokens(args.vocab, args.seq, args.batch, min(args.steps, 500), args.seed)
    model = GPT(args.vocab, args.width, args.layers, args.heads, args.seq)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    warmup = max(1, args.steps // 20)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps)),
    )
    result = gputui.fit(model, data, step, optimizer, scheduler=scheduler, **common.fit_kwargs(args))
    common.finish(model, result, args)


if __name__ == "__main__":
    main()
