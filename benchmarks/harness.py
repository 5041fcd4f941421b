"""What every benchmark module shares: statistics, a private temp dir, child processes in a pseudo-
terminal, CPU steal readings, and the `--json OUT [--quick] [--device D]` entry point.

No torch here: the runner and the process-spawning benchmarks stay light.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import fcntl
import json
import os
import pty
import select
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import termios
import time
from collections.abc import Callable, Iterator
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
NOT_MEASURED = "not measured (no GPU lent)"


def summary(values: list[float]) -> dict[str, Any]:
    """Median, quartiles and range of `values` (and the values themselves, unless there are many)."""
    values = [v for v in values if v is not None]
    if not values:
        return {"n": 0}
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else (values[0],) * 3
    out = {
        "n": len(values),
        "median": statistics.median(values),
        "q1": q1,
        "q3": q3,
        "min": min(values),
        "max": max(values),
    }
    return out if len(values) > 200 else {**out, "values": values}


def fmt(x: float | None, digits: int = 3) -> str:
    """A figure with `digits` significant digits (no exponent for everyday magnitudes)."""
    if x is None:
        return "n/a"
    if x == 0 or abs(x) >= 10 ** (digits - 1):
        return f"{x:,.0f}"
    return f"{x:.{digits}g}"


def spread(s: dict[str, Any], digits: int = 3, unit: str = "") -> str:
    """`median (min-max)` of a summary."""
    if not s.get("n"):
        return "n/a"
    return f"{fmt(s['median'], digits)}{unit} ({fmt(s['min'], digits)}-{fmt(s['max'], digits)})"


def cpu_jiffies() -> tuple[int, int]:
    """(steal, total) jiffies of the whole machine: a VM's vCPUs taken away by the host show as steal."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        return fields[7] if len(fields) > 7 else 0, sum(fields)
    except OSError:
        return 0, 0


def steal_since(start: tuple[int, int]) -> float | None:
    """Percent of machine time stolen by the hypervisor since `start` (None where /proc/stat is missing)."""
    steal, total = cpu_jiffies()
    return None if total == start[1] else 100 * (steal - start[0]) / (total - start[1])


@contextlib.contextmanager
def scratch() -> Iterator[str]:
    """A temp dir, with a private XDG_RUNTIME_DIR inside for job sockets; removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="gputui-bench-") as tmp:
        runtime = os.path.join(tmp, "xdg")
        os.mkdir(runtime, 0o700)
        yield tmp


def child_env(tmp: str, **extra: str) -> dict[str, str]:
    """The environment for a child: its sockets under `tmp`, the real configuration otherwise."""
    env = {k: v for k, v in os.environ.items() if k != "GPUTUI_NO_SOCKET"}
    env.update(XDG_RUNTIME_DIR=os.path.join(tmp, "xdg"), TERM=env.get("TERM", "xterm-256color"), **extra)
    if env["TERM"] in ("", "dumb"):
        env["TERM"] = "xterm-256color"
    return env


def gputui_cmd() -> list[str]:
    """The `gputui` console script beside this Python, else `python -m gputui`."""
    script = os.path.join(os.path.dirname(sys.executable), "gputui")
    return [script] if os.access(script, os.X_OK) else [sys.executable, "-m", "gputui"]


def kill_tree(pid: int) -> None:
    """SIGKILL a child's process group (pty children and `start_new_session` ones lead their own)."""
    for target in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
        try:
            target()
        except (ProcessLookupError, PermissionError):
            pass


class PtyChild:
    """A command on the slave side of a pseudo-terminal of `size` (columns, rows).

    `pump()` reads what it draws, as a terminal would (a full pty would block it); `stop()` sends
    keys, then SIGTERM, then SIGKILL, and always reaps it."""

    def __init__(self, argv: list[str], env: dict[str, str], size: tuple[int, int] = (120, 40)) -> None:
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: size the terminal before the app reads it, then become the command
            try:
                fcntl.ioctl(0, termios.TIOCSWINSZ, struct.pack("HHHH", size[1], size[0], 0, 0))
                os.execvpe(argv[0], argv, env)
            finally:
                os._exit(127)
        self.output = bytearray()
        self.code: int | None = None

    def pump(self, timeout: float = 0.05) -> bool:
        """Read what is there (up to `timeout` s); False once the child has exited."""
        if self.code is None:
            ready, _, _ = select.select([self.fd], [], [], timeout)
            if ready:
                try:
                    data = os.read(self.fd, 1 << 16)
                    self.output += data
                    del self.output[: -(1 << 20)]  # keep the last MiB
                except OSError as exc:  # EIO: the child closed the terminal
                    if exc.errno != errno.EIO:
                        raise
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.code = os.waitstatus_to_exitcode(status)
        return self.code is None

    def wait_for(self, done: Callable[[], bool], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if done():
                return True
            if not self.pump():
                return done()
        return False

    def stop(self, keys: bytes = b"q", grace: float = 10.0) -> int | None:
        try:
            if self.code is None and keys:
                with contextlib.suppress(OSError):
                    os.write(self.fd, keys)
                self.wait_for(lambda: self.code is not None, grace)
            if self.code is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, signal.SIGTERM)
                self.wait_for(lambda: self.code is not None, 3)
        finally:
            if self.code is None:
                kill_tree(self.pid)
                _, status = os.waitpid(self.pid, 0)
                self.code = os.waitstatus_to_exitcode(status)
            with contextlib.suppress(OSError):
                os.close(self.fd)
        return self.code

    def text(self) -> str:
        return self.output.decode("utf-8", "replace")


@contextlib.contextmanager
def background(argv: list[str], env: dict[str, str], **kwargs: Any) -> Iterator[subprocess.Popen]:
    """A child in its own session, killed with its group on the way out, whatever happens."""
    proc = subprocess.Popen(argv, env=env, start_new_session=True, **kwargs)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
        proc.wait()


def wait_until(done: Callable[[], Any], timeout: float, interval: float = 0.01) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = done()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"gave up after {timeout:.0f}s")


def device_of(name: str) -> str:
    """ "auto" is cuda where torch sees a GPU, else cpu."""
    if name != "auto":
        return name
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def main(run: Callable[[bool, str], dict[str, Any]], doc: str | None) -> None:
    """Entry point of a benchmark module: run it, write its figures as JSON."""
    p = argparse.ArgumentParser(description=(doc or "").splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a short version, for development")
    p.add_argument("--device", default="auto", help="cpu, cuda or auto (default)")
    p.add_argument("--json", metavar="OUT", help="write the figures here (default: stdout)")
    args = p.parse_args()
    result = run(args.quick, args.device)
    text = json.dumps(result, indent=1, default=str)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    else:
        print(text)
