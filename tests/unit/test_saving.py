import os

import pytest
import torch

import gputui


def test_save_is_atomic_and_keeps_the_usual_mode(tmp_path):
    path = tmp_path / "model.pt"
    gputui.save({"w": torch.ones(3)}, path)
    assert torch.equal(torch.load(path)["w"], torch.ones(3))
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("cannot pickle this")

    with pytest.raises(RuntimeError, match="cannot pickle"):
        gputui.save({"w": torch.zeros(3), "bad": Unpicklable()}, path)
    assert torch.equal(torch.load(path)["w"], torch.ones(3)), "a failed save must leave the old file whole"
    assert [p.name for p in tmp_path.iterdir()] == ["model.pt"], "no temporary file left behind"
