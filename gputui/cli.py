"""The `gputui` command. Imports stay inside the commands: `gputui --help` must not load torch."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
from collections.abc import Sequence
from functools import partial
from typing import Any

from . import __version__
from .interrupts import notice, ours
from .units import parse_size


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _rate(text: str) -> float:
    try:
        hz = float(text)
    except ValueError:
        hz = 0.0
    if not 1 <= hz <= 30:
        raise argparse.ArgumentTypeError(f"--refresh takes 1 to 30 updates a second, not {text!r}")
    return hz


def _wait(text: str) -> float:
    """`ctl --timeout`: seconds to wait for the job's answer, within what a socket's timeout takes (a day)."""
    try:
        seconds = float(text)
    except ValueError:
        seconds = 0.0
    if not 0 < seconds <= 86400:
        raise argparse.ArgumentTypeError(f"--timeout takes seconds above 0, up to 86400 (a day), not {text!r}")
    return seconds


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gputui",
        description="Train PyTorch models with live GPU memory, live remedies and OOM recovery.",
    )
    parser.add_argument("--version", action="version", version=f"gputui {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    run = commands.add_parser(
        "run",
        help="run a training script under gputui",
        description="Run SCRIPT as `python SCRIPT ARGS...` would, with gputui steering its fit() calls.",
    )
    run.add_argument(
        "--headless", action="store_true", help="no TUI: a progress line on stdout (for nohup, CI and logs)"
    )
    run.add_argument("--metrics", metavar="FILE", help="write one JSON line per step and per event to FILE")
    run.add_argument(
        "--memory-budget",
        metavar="SIZE",
        type=_size,
        help="act as if the device had only SIZE (e.g. 512MiB): crossing it raises "
        "torch.OutOfMemoryError inside the step",
    )
    run.add_argument(
        "--gpu-memory-limit",
        metavar="SIZE",
        type=_size,
        help="on CUDA, let this process allocate only SIZE (e.g. 8GiB): act like a smaller GPU",
    )
    run.add_argument(
        "--memory-history",
        action="store_true",
        default=None,
        help="record the CUDA allocator's history from the start and dump a snapshot at an OOM",
    )
    run.add_argument("--snapshot-dir", metavar="DIR", help="where memory snapshots go (default ./gputui-snapshots)")
    run.add_argument(
        "--refresh", metavar="HZ", type=_rate, default=4.0, help="screen updates per second (default 4; 1 to 30)"
    )
    run.add_argument(
        "--nproc-per-node",
        metavar="N",
        type=int,
        help="launch N processes under torchrun on this node (single node: --standalone), each "
        "`gputui run --headless`, and show rank 0 here: the keys act on every rank",
    )
    run.add_argument("script", metavar="SCRIPT", help="the training script")
    run.add_argument("args", metavar="ARGS", nargs=argparse.REMAINDER, help="arguments for the script")

    jobs = commands.add_parser(
        "jobs",
        help="list your running gputui jobs",
        description="The gputui training processes of this user: one line each.",
    )
    jobs.add_argument("--json", action="store_true", help="print them as JSON")

    attach = commands.add_parser(
        "attach",
        help="watch (or steer) a running job from another terminal",
        description="The same screen as `gputui run`, fed from a running job's socket. Watch-only unless --control.",
    )
    attach.add_argument("target", metavar="PID|SOCKET", nargs="?", help="the job (default: the only one, or ask)")
    attach.add_argument("--control", action="store_true", help="let the keys steer the job, as in `gputui run`")
    attach.add_argument("--json", action="store_true", help="print the latest sample as JSON and exit")
    attach.add_argument("--refresh", metavar="HZ", type=_rate, default=4.0, help="screen updates per second")

    ctl = commands.add_parser(
        "ctl",
        help="send one control to a running job",
        description="Send one control to a running job and print what it applied. ACTION: " + _ctl_actions(),
    )
    ctl.add_argument("target", metavar="PID|SOCKET", help="the job")
    ctl.add_argument("action", metavar="ACTION", nargs="+", help="e.g. halve-batch, amp bf16, checkpointing on")
    ctl.add_argument(
        "--timeout", metavar="S", type=_wait, default=60.0, help="seconds to wait for the job to apply it (default 60)"
    )

    watch = commands.add_parser(
        "watch",
        help="show every GPU and its processes (NVML)",
        description="Show every NVIDIA GPU and the processes on it, as NVML reports them.",
    )
    watch.add_argument("--once", action="store_true", help="print one reading and exit")
    watch.add_argument("--json", action="store_true", help="with --once: print the reading as JSON")
    watch.add_argument("--refresh", metavar="HZ", type=_rate, default=1.0, help="readings per second (default 1)")
    return parser


def _ctl_actions() -> str:
    from .jobs import CTL_ACTIONS

    return CTL_ACTIONS


def _jobs(options: argparse.Namespace) -> int:
    from . import jobs

    try:
        if options.command == "jobs":
            return jobs.list_jobs(options.json, sys.stdout)
        job = jobs.resolve(options.target, choose=options.command == "attach" and not options.json)
        if options.command == "ctl":
            return jobs.ctl(job, options.action, timeout=options.timeout, out=sys.stdout)
        if options.json:
            return jobs.attach_json(job, sys.stdout)
    except jobs.JobError as exc:
        print(f"gputui: error: {exc}", file=sys.stderr)
        return 1
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        print(
            "gputui: error: attach needs a terminal; `gputui attach --json` prints the latest sample", file=sys.stderr
        )
        return 2
    from .tui.runner import attach_tui

    return attach_tui(job.path, job.pid or None, control=options.control, refresh=options.refresh)


def _run(options: argparse.Namespace) -> int:
    from .launch import ScriptNotFound, check_script, run_script, survive_hangup
    from .telemetry.hub import Overrides
    from .telemetry.run import launched_rank
    from .telemetry.setup import opened

    try:
        check_script(options.script)
    except ScriptNotFound as exc:
        print(f"gputui: error: {exc}", file=sys.stderr)
        return 2
    if options.nproc_per_node is not None and options.headless:
        print(
            "gputui: error: --nproc-per-node launches torchrun under the TUI; headless, run torchrun "
            "yourself: `torchrun --nproc-per-node N -m gputui run --headless SCRIPT`",
            file=sys.stderr,
        )
        return 2
    if options.nproc_per_node is not None and options.nproc_per_node < 1:
        print(
            f"gputui: error: --nproc-per-node takes 1 or more processes, not {options.nproc_per_node}", file=sys.stderr
        )
        return 2
    if not options.headless and launched_rank() is not None:
        print(
            "gputui: error: under torchrun every rank would draw its TUI on one terminal; use "
            "`gputui run --headless` and watch any rank with `gputui attach`",
            file=sys.stderr,
        )
        return 2
    if not options.headless and not (sys.stdin.isatty() and sys.stdout.isatty()):
        instead = (
            "`torchrun --nproc-per-node N -m gputui run --headless SCRIPT`"
            if options.nproc_per_node is not None
            else "`gputui run --headless`"
        )
        print(f"gputui: error: the TUI needs a terminal; use {instead} (e.g. under nohup or CI)", file=sys.stderr)
        return 2
    if options.nproc_per_node is not None:
        return _torchrun(options)
    overrides = Overrides(
        memory_budget=options.memory_budget,
        gpu_memory_limit=options.gpu_memory_limit,
        memory_history=options.memory_history,
        snapshot_dir=options.snapshot_dir,
        metrics=options.metrics,
    )
    interrupted = False
    with contextlib.ExitStack() as telemetry:
        try:
            hub = telemetry.enter_context(opened(overrides, progress=sys.stdout if options.headless else None))
        except ValueError as exc:  # the metrics file cannot be written
            print(f"gputui: error: {exc}", file=sys.stderr)
            return 2
        try:
            if options.headless:
                survive_hangup()
                # Started ignoring SIGINT (a shell script's `cmd &`), it still stops the script, as under
                # the TUI and in fit; else a save would replay a second one into the ignore and go on.
                signal.signal(signal.SIGINT, signal.default_int_handler)
                signal.signal(signal.SIGTERM, ours(partial(_terminated, hub)))
                code = run_script(options.script, options.args, observe=hub, output=hub.output.write)
                ended = hub.summary.stopped if hub.summary is not None else None
                # a Ctrl-C's KeyboardInterrupt (not one raised for a SIGTERM, a `gputui ctl stop`, a q)
                interrupted = code == 130 and hub.stop_signal is None and ended in (None, "interrupted")
            else:
                from .tui.local import run_tui

                code = run_tui(hub, options.script, options.args, options.refresh)
        finally:
            # The run is over: a Ctrl-C or SIGTERM now (a second one, while the telemetry closes)
            # would only interrupt the cleanup, leaving a stale socket and printing our own traceback.
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, signal.SIG_IGN)
            if options.headless:
                _say_saved(hub)
    if interrupted:
        # Ended as python ends on a Ctrl-C it did not catch (said already, so without a traceback): its
        # threads joined, its exit handlers run, then killed by SIGINT, so the shell that started it sees a
        # Ctrl-C and stops too (a loop over runs, `a && b`) instead of going on as after an exit code of 130.
        sys.excepthook = lambda *exc: None
        signal.signal(signal.SIGINT, signal.default_int_handler)
        raise KeyboardInterrupt
    return code


def _say_saved(hub: Any) -> None:
    """Headless, the files gputui.save wrote, once the script has ended (the TUI says them as it closes)."""
    from .telemetry.progress import saved_line

    line = saved_line(hub.saved)
    if line is not None:
        with contextlib.suppress(OSError, ValueError):  # a closed stdout: the files are there all the same
            print(line, flush=True)


def _torchrun(options: argparse.Namespace) -> int:
    """`gputui run --nproc-per-node N`: torchrun's ranks headless (this command's flags each), the TUI
    attached to rank 0; the exit code is torchrun's."""
    from .torchrun import JobDied, TorchrunJob

    flags = [
        f"--{name.replace('_', '-')}={value}"
        for name in ("metrics", "memory_budget", "gpu_memory_limit", "snapshot_dir")
        if (value := getattr(options, name)) is not None
    ] + (["--memory-history"] if options.memory_history else [])
    try:
        job = TorchrunJob(
            options.nproc_per_node, ["gputui", "run", "--headless", *flags, options.script, *options.args]
        )
    except ValueError as exc:  # GPUTUI_KILL_AFTER_S
        print(f"gputui: error: {exc}", file=sys.stderr)
        return 2
    print(f"gputui: torchrun: {options.nproc_per_node} processes; their output goes to {job.log}", flush=True)
    try:
        pid, path = job.wait_for_rank0()
    except (JobDied, KeyboardInterrupt) as exc:
        if job.returncode() is None:  # too slow, or Ctrl-C: stop its ranks (killed after job.kill_after s)
            job.stop()
            job.wait()
        if isinstance(exc, JobDied):
            print(f"gputui: {'error: ' if exc.code != 0 else ''}{exc}; its log {job.log} ends with:", file=sys.stderr)
            print("\n".join(job.tail()), file=sys.stderr)
            return exc.code if exc.code is not None else 1
        return job.returncode() or 130
    from .tui.runner import torchrun_tui

    return torchrun_tui(job, pid, path, script=options.script, refresh=options.refresh)


def _terminated(hub: Any, signum: int, frame: Any) -> None:
    """Headless SIGTERM, as under the TUI: the training loop (fit's or the script's own) stops at its
    next step boundary and the script finishes (its save runs); a second one stops at once (143).
    fit, while it runs, has its own handler that does the same."""
    if hub.stop_signal is None:
        hub.stop_signal = "terminated"
        notice("\ngputui: terminated: finishing the current step, then stopping (again to stop at once)\n")
        return
    raise SystemExit(128 + signum)


def _watch(options: argparse.Namespace) -> int:
    from .watch import run_once, run_screen

    if options.once:
        return run_once(options.json, sys.stdout, sys.stderr)
    if options.json:
        print("gputui: error: --json needs --once", file=sys.stderr)
        return 2
    return run_screen(options.refresh, sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    options = _parser().parse_args(argv)
    if options.command == "run":
        return _run(options)
    try:
        if options.command == "watch":
            return _watch(options)
        if options.command in ("jobs", "attach", "ctl"):
            return _jobs(options)
    except BrokenPipeError:  # `gputui jobs | head -1`: the reader has what it wanted
        _quiet_stdout()
        return 1
    _parser().print_help()
    return 2


def _quiet_stdout() -> None:
    """stdout to /dev/null, so the interpreter's last flush into the closed pipe raises nothing."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


if __name__ == "__main__":
    sys.exit(main())
