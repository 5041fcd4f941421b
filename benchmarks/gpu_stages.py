"""The parts of benchmarks/gpu_check.py that run on the device, each in a process of its own:

    python benchmarks/gpu_stages.py env --json OUT     # versions, the device, MIG, the allocator, torch's API
    torchrun --standalone --nproc-per-node 1 benchmarks/gpu_stages.py rank --json OUT

`env` also resolves every `torch.…` name gputui's source uses against this torch (an AST walk), so a
name the image's older torch lacks shows before a stage trips on it. `rank`: one NCCL rank whose
model the script wrapped in DDP (one process under torchrun is not shared unless the model is),
trained by fit under a cap that makes the whole batch run out of memory; its weights against a
plain loop on the same micro-batches.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import json
import os
import platform
import sys
from importlib import metadata
from typing import Any

from harness import ROOT

PACKAGES = ("torch", "nvidia-ml-py", "psutil", "pytest", "pytest-timeout", "textual", "numpy", "transformers")
SIGNATURES = (
    "torch.cuda.memory._record_memory_history",
    "torch.cuda.set_per_process_memory_fraction",
    "torch.amp.GradScaler.__init__",
    "torch.distributed.init_process_group",
    "torch.nn.parallel.DistributedDataParallel.__init__",
)
"""Calls whose keywords moved between torch releases: their signatures here, for whoever reads the summary."""


# -- env ------------------------------------------------------------------------------------
def torch_names(root: str = os.path.join(ROOT, "gputui")) -> set[str]:
    """Every dotted `torch.…` name gputui's source uses: attribute chains rooted at `torch`,
    `from torch.x import y` and `import torch.x`."""
    names: set[str] = set()
    for folder, _, files in os.walk(root):
        for file in files:
            if not file.endswith(".py"):
                continue
            with open(os.path.join(folder, file), encoding="utf-8") as f:
                tree = ast.parse(f.read())
            for node in ast.walk(tree):
                if isinstance(node, ast.Attribute):
                    parts, value = [node.attr], node.value
                    while isinstance(value, ast.Attribute):
                        parts.append(value.attr)
                        value = value.value
                    if isinstance(value, ast.Name) and value.id == "torch":
                        names.add(".".join(["torch", *reversed(parts)]))
                elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "torch":
                    names.update(f"{node.module}.{alias.name}" for alias in node.names)
                elif isinstance(node, ast.Import):
                    names.update(a.name for a in node.names if a.name.split(".")[0] == "torch")
    return names


def lookup(name: str) -> tuple[Any, str | None]:
    """(the object `name` names in this torch, None), or (None, why it is not there)."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:i]))
            break
        except ImportError:
            continue
    else:
        return None, "no such module"
    for j, part in enumerate(parts[i:], start=i):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            return None, f"{'.'.join(parts[:j])} has no {part}"
    return obj, None


def _signature(name: str) -> str:
    obj, missing = lookup(name)
    if missing:
        return f"missing: {missing}"
    try:
        return str(inspect.signature(obj))
    except (ValueError, TypeError) as exc:
        return f"unreadable: {exc}"


def _nvml(cuda_index: int, uuid: str | None) -> dict[str, Any]:
    """What NVML says of the device: driver, MIG mode, whether it sees this process (a container's
    PID namespace hides it), and the other processes on it."""
    from gputui.probes.nvml import cuda_to_nvml_index

    out: dict[str, Any] = {}
    try:
        import pynvml as nvml

        nvml.nvmlInit()
    except Exception as exc:  # no library, no driver: say so, the rest still runs
        return {"error": f"{type(exc).__name__}: {exc}"}
    try:
        out["driver"] = str(nvml.nvmlSystemGetDriverVersion())
        out["cuda_driver"] = nvml.nvmlSystemGetCudaDriverVersion()
        index = cuda_to_nvml_index(cuda_index, cuda_uuid=uuid)
        out["index"] = index
        if index is None:
            return out
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        try:
            current, pending = nvml.nvmlDeviceGetMigMode(handle)
            out["mig"] = {"current": bool(current), "pending": bool(pending)}
        except nvml.NVMLError as exc:
            out["mig"] = f"not readable: {exc}"
        memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        out["memory"] = {"used": memory.used, "total": memory.total}
        pids = [p.pid for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle)]
        out["processes"] = len(pids)
        out["sees_this_process"] = os.getpid() in pids
    except nvml.NVMLError as exc:
        out["error"] = str(exc)
    finally:
        nvml.nvmlShutdown()
    return out


def _nccl() -> str | None:
    import torch
    import torch.distributed as dist

    if not dist.is_nccl_available():
        return None
    version = torch.cuda.nccl.version()  # a tuple; an int in older releases
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def env() -> dict[str, Any]:
    import torch

    index = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    held = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")  # a context, and memory NVML should see
    free, total = torch.cuda.mem_get_info(index)
    uuid = str(getattr(props, "uuid", "")) or None
    names = torch_names()
    missing = {name: why for name in sorted(names) if (why := lookup(name)[1]) is not None}
    packages = {}
    for name in PACKAGES:
        try:
            packages[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            packages[name] = None
    out = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "nccl": _nccl(),
        "devices": torch.cuda.device_count(),
        "device": {
            "name": props.name,
            "capability": f"{props.major}.{props.minor}",
            "total": props.total_memory,
            "multiprocessors": props.multi_processor_count,
            "uuid": uuid,
            "free": free,
            "mem_get_info_total": total,
            "bf16": torch.cuda.is_bf16_supported(),
        },
        "allocator_backend": torch.cuda.get_allocator_backend(),
        "alloc_conf": {k: os.environ.get(k) for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")},
        "nvml": _nvml(index, uuid),
        "packages": packages,
        "torch_names": {"checked": len(names), "missing": missing},
        "signatures": {name: _signature(name) for name in SIGNATURES},
    }
    del held
    return out


# -- rank -----------------------------------------------------------------------------------
BATCH, STEPS = 16384, 4


def rank() -> dict[str, Any]:
    """One NCCL rank: fit under a cap that the whole batch exceeds, against a plain loop."""
    import copy
    import gc

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from helpers import plain_accumulating_loop

    import gputui
    from gputui.telemetry import hub as hubs

    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    try:
        torch.manual_seed(0)
        # Small weights, large activations: what the cap cuts is the micro-batch's.
        model = nn.Sequential(
            nn.Linear(256, 512), *[m for _ in range(6) for m in (nn.Linear(512, 512), nn.Tanh())], nn.Linear(512, 10)
        ).to(device)
        ref = copy.deepcopy(model)
        g = torch.Generator().manual_seed(1)
        batches = [
            (torch.randn(BATCH, 256, generator=g).to(device), torch.randint(10, (BATCH,), generator=g).to(device))
            for _ in range(STEPS)
        ]

        def step(m: nn.Module, batch: Any) -> torch.Tensor:
            return nn.functional.cross_entropy(m(batch[0]), batch[1])

        probe = copy.deepcopy(model)  # the whole batch's step peak, measured on a copy
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step(probe, batches[0]).backward()
        whole = torch.cuda.max_memory_allocated(device) - before
        del probe
        gc.collect()
        torch.cuda.empty_cache()
        limit = torch.cuda.memory_reserved(device) + int(0.6 * whole)

        hub = hubs.Hub()
        hubs.install(hub)
        wrapped = DistributedDataParallel(model, device_ids=[device.index])
        result = gputui.fit(
            wrapped, batches, step, torch.optim.SGD(wrapped.parameters(), lr=0.05), gpu_memory_limit=limit
        )
        sizes = [s.micro_batch for s in hub.samples()]
        torch.cuda.set_per_process_memory_fraction(1.0, device)  # the reference is not capped
        plain_accumulating_loop(ref, batches, step, torch.optim.SGD(ref.parameters(), lr=0.05), sizes)
        diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters(), strict=True))
        return {
            "backend": dist.get_backend(),
            "world_size": dist.get_world_size(),
            "steps": result.steps,
            "ooms_recovered": result.ooms_recovered,
            "micro_batches": sizes,
            "batch": BATCH,
            "limit": limit,
            "whole_step_bytes": whole,
            "max_weight_diff": diff,
            "loss": result.loss,
        }
    finally:
        gc.collect()  # the DDP wrapper before its group
        dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["env", "rank"])
    p.add_argument("--json", required=True, metavar="OUT", help="write the figures here")
    args = p.parse_args()
    out = env() if args.what == "env" else rank()
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1, default=str)
    print(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
