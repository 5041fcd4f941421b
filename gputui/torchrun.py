"""`gputui run --nproc-per-node N`: torchrun's workers run headless, one TUI attaches to rank 0.

torchrun runs in a session of its own, its output (and every rank's) in a log file, so nothing
writes over the screen and a hang-up of the terminal reaches neither it nor the ranks. torchrun
starts each worker in a session of its own too: the ranks are found as its children (their RANK
in their environment), rank 0's socket is the one the TUI attaches to. A stop is SIGINT to every
rank's process group, as torchrun passes on a Ctrl-C (fit agrees the stop, so every rank stops after
the same step and the script's save runs), but not to torchrun itself, which would then report the
job as failed with a traceback of its own even when every rank ended well. No torch, no textual here.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque

import psutil

from .telemetry.paths import socket_path
from .units import seconds_from_env

KILL_AFTER = 30.0
"""Seconds a stopped job gets before its processes are killed: torchrun's own grace after a Ctrl-C.
GPUTUI_KILL_AFTER_S sets another (torchrun still kills its workers 30 s after a Ctrl-C it passes on)."""

START_TIMEOUT = 120.0
"""Seconds torchrun may take to start rank 0 and rank 0 to serve its socket (before its script runs)."""

TAIL = 15
"""The log's lines printed when the job ends or fails to start."""


class JobDied(Exception):
    """torchrun ended before rank 0 served its socket (`code`: its exit code), or it took too long (None)."""

    def __init__(self, message: str, code: int | None) -> None:
        super().__init__(message)
        self.code = code


class TorchrunJob:
    """One `torchrun --standalone --nproc_per_node=N -m gputui run --headless ...` on this node."""

    def __init__(self, nproc: int, command: list[str]) -> None:
        """`command`: what each rank runs after `python -m` (`gputui run --headless ... SCRIPT ARGS`).
        ValueError, before anything starts, for a GPUTUI_KILL_AFTER_S that is not a number of seconds."""
        self.nproc = nproc
        self.kill_after = seconds_from_env("GPUTUI_KILL_AFTER_S", KILL_AFTER)
        fd, self.log = tempfile.mkstemp(prefix="gputui-torchrun-", suffix=".log")
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m"]
        try:
            self.process = subprocess.Popen(
                [*argv, *command], stdin=subprocess.DEVNULL, stdout=fd, stderr=fd, start_new_session=True
            )
        finally:
            os.close(fd)
        self._ranks: dict[int, int] = {}  # rank -> pid, as last seen among torchrun's children
        self._stops = 0
        self._lock = threading.Lock()

    def ranks(self) -> dict[int, int]:
        """rank -> pid of the workers torchrun has started (remembered: after torchrun is gone its
        children are no longer its)."""
        try:
            children = psutil.Process(self.process.pid).children()
        except psutil.Error:
            children = []
        for child in children:
            try:
                rank = child.environ().get("RANK")
            except psutil.Error:  # gone, or not readable yet
                continue
            if rank is not None and rank.isdigit():
                self._ranks[int(rank)] = child.pid
        return dict(self._ranks)

    def wait_for_rank0(self, timeout: float = START_TIMEOUT) -> tuple[int, str]:
        """Rank 0's pid and socket, once it serves it; JobDied if torchrun ends first or in `timeout` s."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid = self.ranks().get(0)
            if pid is not None and os.path.exists(path := socket_path(pid)):
                return pid, path
            code = self.wait(0.1)
            if code is not None:
                raise JobDied(f"torchrun ended with exit code {code} before rank 0 served its socket", code)
        raise JobDied(f"rank 0 served no socket within {timeout:g} s", None)

    def returncode(self) -> int | None:
        """torchrun's exit code once it has ended (128 + N when a signal N ended it), else None."""
        code = self.process.poll()
        return None if code is None else 128 - code if code < 0 else code

    def wait(self, timeout: float | None = None) -> int | None:
        """torchrun's exit code, waiting up to `timeout` s (None: until it ends); None if it runs on."""
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        return self.returncode()

    def stop(self) -> None:
        """SIGINT to every rank: the first stops each after the same step (and the script goes on to its
        save), the next one at once; the job is killed `kill_after` s after the first."""
        with self._lock:
            self._stops += 1
            first = self._stops == 1
        self._signal(signal.SIGINT)
        if first:
            timer = threading.Timer(self.kill_after, self.kill)
            timer.daemon = True
            timer.start()

    def kill(self) -> None:
        """SIGKILL to every rank's process group and to torchrun's, if the job is still running."""
        self._signal(signal.SIGKILL)
        self._killpg(self.process.pid, signal.SIGKILL)

    def _signal(self, signum: int) -> None:
        """To every rank, while torchrun runs (once it has ended, so have they: their pids may be reused)."""
        if self.process.poll() is None:
            for pid in self.ranks().values():
                self._killpg(pid, signum)

    def _killpg(self, pid: int, signum: int) -> None:
        """The process's group (torchrun starts each worker as its group's leader: its DataLoader workers too)."""
        if self.process.poll() is not None:
            return
        try:
            os.killpg(os.getpgid(pid), signum)
        except (ProcessLookupError, PermissionError):
            pass

    def tail(self, lines: int = TAIL) -> list[str]:
        """The log's last lines."""
        try:
            with open(self.log, encoding="utf-8", errors="replace") as log:
                return [line.rstrip("\n") for line in deque(log, maxlen=lines)]
        except OSError:
            return []
