import os
import subprocess
import sys

import pytest
import torch

ALONE = "GPUTUI_TEST_ALONE"  # set to a test's node id in the process that runs it alone
ALONE_S = 300  # a test alone that hangs fails after this, rather than holding the device call


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """A test marked `alone` runs in a fresh interpreter: a memory cap's room is only what the test sets
    when no earlier test left segments behind. In one pytest process the tests before it left 120 MiB
    of holes on an H200, reserved between live blocks, which made a cap either too loose for any OOM or
    too tight for one sample, whichever way it was counted."""
    if "alone" not in pyfuncitem.keywords or os.environ.get(ALONE) == pyfuncitem.nodeid:
        return None
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE", pyfuncitem.nodeid]
    env = {**os.environ, ALONE: pyfuncitem.nodeid}
    try:
        done = subprocess.run(
            argv, cwd=pyfuncitem.config.rootpath, env=env, capture_output=True, text=True, timeout=ALONE_S
        )
    except subprocess.TimeoutExpired as hung:
        out = hung.stdout.decode(errors="replace") if isinstance(hung.stdout, bytes) else hung.stdout or ""
        pytest.fail(f"alone, still running after {ALONE_S} s:\n{out[-4000:]}", pytrace=False)
    if done.returncode != 0:
        pytest.fail(f"alone, exit code {done.returncode}:\n{done.stdout[-6000:]}{done.stderr[-2000:]}", pytrace=False)
    return True
