"""Demo: a residual MLP learns a random teacher network's labels (synthetic data, nothing downloaded).

python demos/mlp.py                      # headless, with a progress line
gputui run --headless demos/mlp.py --memory-budget 8MiB   # watch OOMs being recovered
torchrun --nproc-per-node 2 demos/mlp.py # two ranks (DDP); `gputui jobs` lists both
"""

from __future__ import annotations

import common
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import gputui

# width, depth
SIZES = {"tiny": (32, 2), "small": (128, 4), "large": (2048, 16)}


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class MLP(nn.Module):
    def __init__(self, features: int, width: int, depth: int, classes: int) -> None:
        super().__init__()
        self.inp = nn.Linear(features, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def main() -> None:
    p = common.parser(__doc__.splitlines()[0], steps=400, batch=256)
    p.add_argument(
        "--size",
        choices=sorted(SIZES),
        default=None,
        help="a preset for --width and --depth (default: small on a CPU, large on a GPU)",
    )
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--depth", type=int, default=None)
    p.add_argument("--features", type=int, default=64)
    p.add_argument("--classes", type=int, default=10)
    args = p.parse_args()
    common.apply_size(args, SIZES, ("width", "depth"))

    torch.manual_seed(args.seed)
    teacher = nn.Sequential(nn.Linear(args.features, 64), nn.Tanh(), nn.Linear(64, args.classes))
    n = args.batch * min(args.steps, 200)  # up to 200 distinct batches, reshuffled each epoch
    x = torch.randn(n, args.features)
    with torch.no_grad():
        y = teacher(x).argmax(dim=1)
    dataset = TensorDataset(x, y)
    rank, world = common.world()
    if world > 1:  # under torchrun: each rank trains its share of every global batch
        sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, drop_last=True)
        data = DataLoader(dataset, batch_size=args.batch // world, sampler=sampler, drop_last=True)
    else:
        data = DataLoader(dataset, batch_size=args.batch, shuffle=True, drop_last=True)

    model = MLP(args.features, args.width, args.depth, args.classes)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    result = gputui.fit(model, data, step, optimizer, **common.fit_kwargs(args))
    common.finish(model, result, args)


if __name__ == "__main__":
    main()
