"""Split a global batch along dim 0 into micro-batches, whatever container holds it.

A batch is a tree of tensors in tuples, lists, dicts, dataclasses or namedtuples. Every tensor
whose first dimension is the batch size is split, and so is every list of the batch's samples (tensors
of different lengths, a string or a record each): sliced, each sample whole. Anything else (scalars,
a tensor of another length, a plain dict) is carried along whole into every micro-batch.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from itertools import accumulate, pairwise, repeat
from operator import attrgetter
from typing import Any

import torch


def _size(batch: Any, nested: bool = False) -> int | None:
    """The batch size: dim 0 of the first tensor, or the length of the first list of samples it meets."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() > 0 else None
    # These walks run every step: a tuple's children and tensor leaves are taken here, without a call.
    children = batch if isinstance(batch, (tuple, list)) else _children(batch)
    for child in children:
        if isinstance(child, torch.Tensor):
            if child.dim() == 0:
                continue
            size = child.shape[0]
            # The batch's own list of two is (inputs, labels), every step: its fields, read as before. A
            # list of samples (longer, or nested) differs somewhere: one read a tensor.
            if children is not batch or len(batch) < (2 if nested else 3):
                return size
            if not nested:
                try:
                    for other in batch:
                        if isinstance(other, _Tensor) and other.shape[0] != size:
                            break
                    else:
                        return size
                except IndexError:  # a scalar among them: _samples reads it whole
                    pass
            return len(batch) if _samples(batch, nested) else size
        found = _size(child, True)
        if found is not None:
            return found
    return None


def _samples(seq: Sequence[Any], nested: bool) -> bool:
    """Whether a list or tuple holds samples, not a batch's fields: tensors of one rank and dtype whose
    first dimensions differ (variable-length sequences: what a collate_fn that does not stack gives), or,
    inside the batch's own container, whose shapes differ (images of different sizes, as torchvision's
    detection collate gives them). Fields share the batch's first dimension (a seq2seq batch's source and
    target may differ after it), and a namedtuple names fields."""
    first = seq[0] if len(seq) > 1 else None
    if not isinstance(first, torch.Tensor) or first.dim() == 0:
        return False
    rank, dtype, size = first.dim(), first.dtype, first.shape[0]
    differ = False
    for item in seq:
        if not isinstance(item, torch.Tensor) or item.dim() != rank or item.dtype != dtype:
            return False
        differ = differ or (item.shape != first.shape if nested else item.shape[0] != size)
    return differ and not hasattr(seq, "_fields")


def _per_sample(seq: Sequence[Any], total: int, nested: bool) -> bool:
    """Whether split() slices `seq` as samples: a list of samples (_samples) of the batch's size, or, inside
    the batch's own container (which holds its fields), a list or tuple of `total` strings or of `total`
    records of one type (a caption each, a target dict each)."""
    if len(seq) != total or total < 2 or hasattr(seq, "_fields"):
        return False
    kind = type(seq[0])
    if nested and (kind is str or (not isinstance(seq[0], torch.Tensor) and _children(seq[0]))):
        return all(type(item) is kind for item in seq)
    return _samples(seq, nested)


def _children(batch: Any) -> Sequence[Any]:
    if isinstance(batch, (tuple, list)):  # first: the common case, and cheaper than the ABC check
        return batch
    if isinstance(batch, Mapping):
        return list(batch.values())
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return [getattr(batch, f.name) for f in dataclasses.fields(batch)]
    return []


def batch_size(batch: Any) -> int:
    """Length of dim 0 of the first tensor in the batch, or of the first list of samples (_samples) it
    holds; ValueError if it holds neither."""
    size = _size(batch)
    if size is None:
        raise ValueError(
            f"a batch must hold at least one tensor with a batch dimension, in a tuple, list, dict, dataclass or "
            f"namedtuple (what gputui can split and move); got {type(batch).__name__}"
        )
    return size


def shapes(batch: Any) -> Any:
    """The shapes and dtypes of a batch's tensors, nested as the batch is: hashable, equal for two
    batches that train the same way."""
    if isinstance(batch, torch.Tensor):
        return _shape(batch)
    children = batch if isinstance(batch, (tuple, list)) else _children(batch)
    if not children:
        return None
    if all(map(isinstance, children, _TENSOR)):  # most batches: read in C, no frame a child (a CPU run's every step)
        return tuple(map(_shape, children))
    return tuple([_shape(c) if isinstance(c, torch.Tensor) else shapes(c) for c in children])


_shape = attrgetter("shape", "dtype")
_Tensor = torch.Tensor  # a global read, not the module's attribute: _size runs every step
_TENSOR = repeat(torch.Tensor)  # isinstance's second argument, for each child


def _rebuild(batch: Any, fn: Callable[[Any], Any]) -> Any:
    """The same container with `fn` applied to each child."""
    if isinstance(batch, Mapping):
        mapped = {k: fn(v) for k, v in batch.items()}
        make: Callable[..., Any] = type(batch)  # dict-like: built from a dict (Mapping's own __init__ takes none)
        try:
            return make(mapped)
        except TypeError:
            return mapped
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(fn(v) for v in batch))
    if isinstance(batch, (tuple, list)):
        items = [fn(v) for v in batch]
        try:
            return type(batch)(items)
        except TypeError:
            return items if isinstance(batch, list) else tuple(items)
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        rebuilt = copy.copy(batch)  # no __init__/__post_init__ rerun; works for frozen and slots too
        for f in dataclasses.fields(batch):
            object.__setattr__(rebuilt, f.name, fn(getattr(batch, f.name)))
        return rebuilt
    return batch


def _fields(batch: Any) -> tuple[dict[str, Any], str]:
    """A batch's named fields, and how a script reads one (`{}` for a batch that names none)."""
    if isinstance(batch, Mapping):
        return dict(batch), 'batch["{}"]'
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return dict(zip(batch._fields, batch, strict=True)), "batch.{}"
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}, "batch.{}"
    return {}, ""


def token_weighted(batch: Any) -> tuple[str, str] | None:
    """Why a batch looks made for a loss that is a mean over tokens (Hugging Face's labels of -100
    on padding, an attention mask with padding), and the items= that counts them as a causal LM's
    loss does (it drops each sequence's first label: `[:, 1:]`); None when nothing says so. Read
    once a run: the test reads values (a device sync on a GPU batch)."""
    fields, read = _fields(batch)
    labels, mask = fields.get("labels"), fields.get("attention_mask")
    if isinstance(labels, torch.Tensor) and bool((labels == -100).any()):
        field = read.format("labels") + ("[:, 1:]" if labels.dim() > 1 else "")
        return "its labels hold -100 (positions the loss ignores)", f"items=lambda batch: ({field} != -100).sum()"
    if isinstance(mask, torch.Tensor) and bool((mask == 0).any()):
        field = read.format("attention_mask") + ("[:, 1:]" if mask.dim() > 1 else "")
        return "its attention_mask has padding", f"items=lambda batch: {field}.sum()"
    return None


def tensors(batch: Any) -> list[torch.Tensor]:
    """Every tensor in the batch, in the containers split() walks (dataclasses too, which pytree skips)."""
    if isinstance(batch, torch.Tensor):
        return [batch]
    return [t for child in _children(batch) for t in tensors(child)]


def map_tensors(batch: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """The same batch with `fn` applied to each tensor, rebuilt as split() rebuilds it."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if not _children(batch):
        return batch
    return _rebuild(batch, lambda child: map_tensors(child, fn))


def sizes(total: int, size: int, smallest: int = 1) -> list[int]:
    """How split() cuts `total` samples: `size` each, the rest last. A rest smaller than `smallest`
    joins the micro-batch before it: BatchNorm cannot normalize one sample in training."""
    full, rest = divmod(total, size)
    if full == 0:
        return [total]
    cut = [size] * full
    if rest >= smallest:
        cut.append(rest)
    elif rest:
        cut[-1] += rest
    return cut


def split(batch: Any, size: int, total: int | None = None, smallest: int = 1) -> list[Any]:
    """Micro-batches as sizes() cuts them (views, not copies): `size` samples, the last one may differ."""
    total = batch_size(batch) if total is None else total
    if size >= total:  # one piece, the batch itself: most steps
        return [batch]
    cut = sizes(total, size, smallest)
    count = len(cut)
    if count == 1:
        return [batch]

    def pieces(node: Any) -> list[Any]:
        if isinstance(node, torch.Tensor):
            if node.dim() > 0 and node.shape[0] == total:
                return list(node.split(cut))
            return [node] * count
        if isinstance(node, (tuple, list)) and _per_sample(node, total, node is not batch):
            return [node[a:b] for a, b in pairwise(accumulate(cut, initial=0))]
        if isinstance(node, (tuple, list)) and _samples(node, node is not batch):
            raise ValueError(
                f"a list of {len(node)} samples (tensors of different lengths) in a batch of {total}: gputui cannot "
                "tell which samples go together to micro-batch it; give each sample's fields as one list each"
            )
        children = _children(node)
        if not children:
            return [node] * count
        split_children = [pieces(c) for c in children]
        return [_rebuild_from(node, [sc[i] for sc in split_children]) for i in range(count)]

    return pieces(batch)


def _rebuild_from(node: Any, values: list[Any]) -> Any:
    it = iter(values)
    return _rebuild(node, lambda _old: next(it))


def to_device(batch: Any, device: torch.device) -> Any:
    """Move every tensor to `device`; pinned host tensors are copied without blocking."""
    if isinstance(batch, torch.Tensor):
        if batch.device == device:
            return batch
        return batch.to(device, non_blocking=batch.is_pinned())
    children = batch if isinstance(batch, (tuple, list)) else _children(batch)
    for child in children:
        if not isinstance(child, torch.Tensor) or child.device != device:
            break
    else:
        return batch  # tensors already there (every step on a CPU): no walk further, no new container
    moved = [to_device(child, device) for child in children]
    if all(new is old for new, old in zip(moved, children, strict=True)):
        return batch
    return _rebuild_from(batch, moved)
