from collections import OrderedDict, namedtuple
from dataclasses import dataclass, field

import pytest
import torch

from gputui.step.microbatch import batch_size, shapes, split, to_device

Pair = namedtuple("Pair", "x y")


@dataclass
class Batch:
    x: torch.Tensor
    mask: torch.Tensor
    name: str = "b"


@dataclass(frozen=True)
class Frozen:
    x: torch.Tensor
    cached: int = field(init=False, default=7)


def test_tensor_split_uneven_views():
    x = torch.arange(10).view(10, 1)
    parts = split(x, 4)
    assert [p.shape[0] for p in parts] == [4, 4, 2]
    assert torch.equal(torch.cat(parts), x)
    assert all(p.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() for p in parts)  # views


def test_whole_batch_when_size_covers_it():
    x = torch.zeros(6, 2)
    assert split(x, 6)[0] is x and split(x, 100)[0] is x


def test_nested_containers_and_carried_leaves():
    batch = {
        "pair": Pair(torch.arange(5), torch.arange(5) * 2),
        "ids": [torch.ones(5, 3), "tag"],
        "scale": torch.tensor(2.0),
        "classes": torch.arange(3),
        "meta": {"epoch": 1},
    }
    parts = split(batch, 2)
    assert len(parts) == 3
    assert [p["pair"].x.tolist() for p in parts] == [[0, 1], [2, 3], [4]]
    assert isinstance(parts[0]["pair"], Pair) and parts[2]["pair"].y.tolist() == [8]
    assert parts[1]["ids"][0].shape == (2, 3) and parts[1]["ids"][1] == "tag"
    for p in parts:  # a scalar, a tensor of another length and a plain dict are carried whole
        assert p["scale"] is batch["scale"] and p["classes"] is batch["classes"] and p["meta"] == {"epoch": 1}


def test_tuple_list_ordereddict_types_kept():
    assert isinstance(split((torch.ones(4), torch.ones(4)), 2)[0], tuple)
    assert isinstance(split([torch.ones(4)], 2)[0], list)
    od = split(OrderedDict(a=torch.ones(4)), 3)
    assert isinstance(od[0], OrderedDict) and od[1]["a"].shape == (1,)


def test_dataclasses_plain_and_frozen():
    parts = split(Batch(torch.arange(6), torch.ones(6, 2)), 4)
    assert isinstance(parts[0], Batch) and parts[1].x.tolist() == [4, 5] and parts[1].name == "b"
    frozen = split(Frozen(torch.arange(3)), 2)
    assert frozen[1].x.tolist() == [2] and frozen[1].cached == 7


def test_batch_size_finds_first_batched_tensor():
    assert batch_size({"scalar": torch.tensor(1.0), "x": [torch.ones(7, 2)]}) == 7
    with pytest.raises(ValueError, match="at least one tensor"):
        batch_size({"a": 1, "b": "text"})
    with pytest.raises(ValueError):
        batch_size(torch.tensor(3.0))


def test_to_device_keeps_structure():
    batch = Batch(torch.ones(2), torch.zeros(2, 2))
    moved = to_device(batch, torch.device("cpu"))
    assert isinstance(moved, Batch) and moved.x is batch.x  # already there: no copy
    assert to_device(("a", 3), torch.device("cpu")) == ("a", 3)


def test_shapes_tell_apart_batches_that_train_differently_whatever_holds_them():
    """The memory tracker recounts, and the planner predicts again, when a batch's shapes change: the key
    must change with any tensor's shape or dtype, wherever it sits, and stay equal for a batch alike."""
    x, y = torch.zeros(8, 3), torch.zeros(8, dtype=torch.long)
    assert shapes((x, y)) == shapes((torch.ones(8, 3), torch.ones(8, dtype=torch.long)))
    assert shapes((x, y)) != shapes((x, torch.zeros(8, 2, dtype=torch.long))), "the second tensor's shape"
    assert shapes([x, y]) != shapes([x, y.float()]), "a dtype"
    assert shapes({"ids": x, "labels": y}) != shapes({"ids": x, "labels": y[:4]})
    nested = {"pair": Pair(x, y), "n": 3, "name": "b"}  # containers and leaves that are not tensors
    assert shapes(nested) == shapes({"pair": Pair(torch.ones(8, 3), y), "n": 3, "name": "b"})
    assert shapes(nested) != shapes({"pair": Pair(x, y[:5]), "n": 3, "name": "b"})
    assert shapes(Batch(x, torch.ones(8, 3))) != shapes(Batch(x, torch.ones(8, 4)))
    hash(shapes(nested))


def test_shapes_walk_into_containers_that_have_a_shape_of_their_own():
    """A TensorDict is a mapping whose .shape is its batch size alone (and a tensorclass a dataclass with
    one): its key is its tensors', not its own shape and dtype. A NumPy array is no tensor: a batch of
    paths (its dtype as long as the longest) keys alike from batch to batch."""
    import numpy as np

    class TensorDictLike(dict):
        shape, dtype = torch.Size([4]), torch.float32

    @dataclass
    class TensorclassLike:
        obs: torch.Tensor
        shape = torch.Size([4])
        dtype = torch.float32

    labels = torch.zeros(4)
    assert shapes((TensorDictLike(obs=torch.zeros(4, 16)), labels)) != shapes(
        (TensorDictLike(obs=torch.zeros(4, 32)), labels)
    )
    small, large = TensorclassLike(torch.zeros(4, 16)), TensorclassLike(torch.zeros(4, 32))
    assert shapes((small, labels)) != shapes((large, labels))
    paths = np.array(["a.jpg", "bbbb.jpg"]), np.array(["c.jpg", "d.jpg"])
    assert shapes((labels, paths[0])) == shapes((labels, paths[1]))


SEQS = [torch.arange(6), torch.arange(6, 9), torch.arange(9, 15)]  # what pack_sequence takes: one tensor a sample


def test_a_list_of_samples_is_the_batch_and_each_sample_stays_whole():
    """A collate_fn that does not stack (variable-length sequences, torchvision's detection batches) gives
    lists with a tensor, a record or a string a sample: the batch size is the list's length, and a
    micro-batch takes whole samples (cutting every tensor as long as the first one cut samples apart)."""
    targets = [{"label": torch.tensor(i)} for i in range(3)]
    batch = (SEQS, targets, ["a", "b", "c"])
    assert batch_size(batch) == 3 and batch_size(SEQS) == 3
    parts = split(batch, 2)
    assert [[s.tolist() for s in p[0]] for p in parts] == [[SEQS[0].tolist(), SEQS[1].tolist()], [SEQS[2].tolist()]]
    assert [[t["label"].item() for t in p[1]] for p in parts] == [[0, 1], [2]] and [p[2] for p in parts] == [
        ["a", "b"],
        ["c"],
    ]
    images = tuple(torch.ones(3, 20 + k, 24) for k in range(4))  # one channel count, sizes that differ
    parts = split((images, tuple({"label": k} for k in range(4))), 2)
    assert batch_size((images, ())) == 4 and [len(p[0]) for p in parts] == [2, 2]
    assert all(i.shape[0] == 3 for p in parts for i in p[0])  # no image cut along its channels


def test_fields_stay_fields_and_samples_of_another_length_are_refused():
    src, tgt = torch.ones(4, 5, dtype=torch.long), torch.ones(4, 7, dtype=torch.long)  # seq2seq: fields
    assert batch_size((src, tgt)) == 4 and [p[1].shape for p in split((src, tgt), 2)] == [(2, 7), (2, 7)]
    batch = {"x": torch.ones(4, 2), "lengths": SEQS}  # three samples in a batch of four: no guess, no cut
    with pytest.raises(ValueError, match="a list of 3 samples .* in a batch of 4: gputui cannot tell"):
        split(batch, 2)
    pair = [torch.arange(5), torch.arange(7)]  # the batch's own pair is (inputs, labels): a 2-sample list is
    with pytest.raises(ValueError, match="a list of 2 samples"):  # refused when cut, never cut apart
        split(pair, 1)


class _PackedGru(torch.nn.Module):
    """A GRU over variable-length sequences, as a speech or text model takes them: pack_sequence of a list."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.gru, self.head = torch.nn.Embedding(16, 4), torch.nn.GRU(4, 4), torch.nn.Linear(4, 2)

    def forward(self, seqs):
        packed = torch.nn.utils.rnn.pack_sequence([self.embed(s) for s in seqs], enforce_sorted=False)
        return self.head(self.gru(packed)[1][0])


def _packed_step(model, batch):
    seqs, targets = batch
    return torch.nn.functional.cross_entropy(model(seqs), torch.stack([t["label"] for t in targets]))


@pytest.mark.parametrize("micro_batch", [1, 2])
def test_fit_in_micro_batches_of_whole_samples_gives_the_whole_batchs_gradient(micro_batch):
    import gputui

    batch = ([s % 16 for s in SEQS], [{"label": torch.tensor(i % 2)} for i in range(3)])
    torch.manual_seed(0)
    model = _PackedGru()
    _packed_step(model, batch).backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    grads = []

    class Capture(torch.optim.SGD):
        def step(self, closure=None):
            grads.extend(p.grad.clone() for p in model.parameters())

    result = gputui.fit(model, [batch], _packed_step, Capture(model.parameters(), lr=0.0), micro_batch=micro_batch)
    assert result.samples == 3 and result.micro_batch == micro_batch
    for g, e in zip(grads, expected, strict=True):
        torch.testing.assert_close(g, e, atol=1e-6, rtol=1e-5)
