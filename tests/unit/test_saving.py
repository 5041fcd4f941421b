import io
import os
import sys

import pytest
import torch
from process import wait_until

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


def test_a_save_keeps_the_mode_of_the_file_it_replaces(tmp_path):
    path = tmp_path / "model.pt"
    path.write_bytes(b"old")
    path.chmod(0o600)  # a private checkpoint stays private
    gputui.save({"w": torch.ones(3)}, path)
    assert path.stat().st_mode & 0o777 == 0o600
    path.chmod(0o640)
    gputui.save({"w": torch.ones(3)}, path)
    assert path.stat().st_mode & 0o777 == 0o640


def test_a_save_through_a_symlink_replaces_its_target_and_keeps_the_link(tmp_path):
    (tmp_path / "run3").mkdir()
    target = tmp_path / "run3" / "ck.pt"
    gputui.save({"step": 1}, target)
    link = tmp_path / "latest.pt"
    link.symlink_to("run3/ck.pt")
    gputui.save({"step": 2}, link)
    assert link.is_symlink() and os.readlink(link) == "run3/ck.pt", "the link stays a link, to the same file"
    assert torch.load(target)["step"] == 2, "the target is the new file"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest.pt", "run3"]
    assert [p.name for p in (tmp_path / "run3").iterdir()] == ["ck.pt"], "the temporary file went beside the target"
    (tmp_path / "next.pt").symlink_to("run4.pt")  # a link to a file not yet made: the save makes it
    gputui.save({"step": 3}, tmp_path / "next.pt")
    assert (tmp_path / "next.pt").is_symlink() and torch.load(tmp_path / "run4.pt")["step"] == 3


STALLED_SAVE = """
import sys, time
import gputui, torch

class Stall:  # pickled mid-save: says so, then never returns
    def __reduce__(self):
        open(sys.argv[2], "w").close()
        time.sleep(600)

gputui.save({"w": torch.ones(1 << 16), "stall": Stall()}, sys.argv[1])
"""


@pytest.mark.process  # two children importing torch
def test_a_save_removes_the_temporary_files_of_saves_killed_midway_and_no_other(tmp_path, processes):
    path = tmp_path / "ck.pt"
    children = [processes.start([sys.executable, "-c", STALLED_SAVE, path, tmp_path / f"saving{i}"]) for i in (1, 2)]
    for i, child in enumerate(children, 1):
        wait_until((tmp_path / f"saving{i}").exists, message="the child never got to its save", process=child)
    temps = {p.name for p in tmp_path.iterdir() if p.name.startswith(".ck.pt.")}
    assert len(temps) == 2, "each stalled save has its temporary file"
    killed, alive = children
    killed.kill()  # SIGKILL mid-save: nothing of it runs again
    killed.wait()
    gputui.save({"w": torch.zeros(1)}, path)
    left = {p.name for p in tmp_path.iterdir() if p.name.startswith(".ck.pt.")}
    assert len(left) == 1 and f".{alive.pid}." in left.pop(), "the dead save's file went, the live one's stays"
    assert torch.equal(torch.load(path)["w"], torch.zeros(1))


def test_a_failed_save_names_the_path_given_and_a_file_object_is_written_as_torch_save_writes_it(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"No such file or directory: '{tmp_path}/missing/m.pt'$"):
        gputui.save({"w": torch.ones(2)}, tmp_path / "missing" / "m.pt")
    with pytest.raises(IsADirectoryError, match=f"Is a directory: '{tmp_path}'$"):
        gputui.save({"w": torch.ones(2)}, tmp_path)
    assert os.listdir(tmp_path) == []  # no temporary file left behind
    buffer = io.BytesIO()
    gputui.save({"w": torch.ones(2)}, buffer)
    buffer.seek(0)
    assert torch.equal(torch.load(buffer)["w"], torch.ones(2))
