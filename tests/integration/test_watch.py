"""`gputui watch` in a real process, on whatever NVML this machine has (CI: none)."""

import json

import pytest
from process import gputui, python

from gputui.probes.nvml import read_gpus

NVML = read_gpus()


@pytest.mark.parametrize("args", [("--once", "--json"), ("--once",)])
def test_watch_once(args):
    done = gputui("watch", *args)

    if NVML.status is None:  # a machine with a driver: the reading itself
        assert done.returncode == 0 and done.stderr == ""
        if "--json" in args:
            assert len(json.loads(done.stdout)["devices"]) == len(NVML.devices)
        else:
            assert len(done.stdout.splitlines()) == 1 + len(NVML.devices)
        return
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr == f"gputui: {NVML.status}\n"
    assert done.stderr.startswith("gputui: ") and len(done.stderr.splitlines()) == 1


def test_watch_screen_without_a_driver_fails_cleanly():
    if NVML.status is None:
        pytest.skip("this machine has an NVIDIA driver: the screen would start")
    done = gputui("watch")

    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr == f"gputui: {NVML.status}\n"


def test_watch_never_imports_torch():
    code = (
        "import sys; from gputui.cli import main; code = main(['watch', '--once', '--json']); "
        "print('torch' in sys.modules, 'textual' in sys.modules, code in (0, 1))"
    )
    done = python("-c", code)

    assert done.stdout.splitlines()[-1] == "False False True"
