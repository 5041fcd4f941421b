"""The `gputui` command. Imports stay inside the commands: `gputui --help` must not load torch."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from . import __version__
from .units import parse_size


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


SCRIPT_TAIL = 15
"""Lines of the script's own output printed when the TUI closes."""


def _rate(text: str) -> float:
    try:
        hz = float(text)
    except ValueError:
        hz = 0.0
    if not 1 <= hz <= 30:
        raise argparse.ArgumentTypeError(f"--refresh takes 1 to 30 updates a second, not {text!r}")
    return hz


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gputui",
        description="Train PyTorch models with live GPU memory, live remedies and OOM recovery.",
    )
    parser.add_argument("--version", action="version", version=f"gputui {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    run = commands.add_parser(
        "run", help="run a training script under gputui",
        description="Run SCRIPT as `python SCRIPT ARGS...` would, with gputui steering its fit() calls.",
    )
    run.add_argument("--headless", action="store_true",
                     help="no TUI: a progress line on stdout (for nohup, CI and logs)")
    run.add_argument("--metrics", metavar="FILE",
                     help="write one JSON line per step and per event to FILE")
    run.add_argument("--memory-budget", metavar="SIZE", type=_size,
                     help="act as if the device had only SIZE (e.g. 512MiB): crossing it raises "
                          "torch.OutOfMemoryError inside the step")
    run.add_argument("--gpu-memory-limit", metavar="SIZE", type=_size,
                     help="on CUDA, let this process allocate only SIZE (e.g. 8GiB): act like a smaller GPU")
    run.add_argument("--memory-history", action="store_true", default=None,
                     help="record the CUDA allocator's history from the start and dump a snapshot at an OOM")
    run.add_argument("--snapshot-dir", metavar="DIR", help="where memory snapshots go (default ./gputui-snapshots)")
    run.add_argument("--refresh", metavar="HZ", type=_rate, default=4.0,
                     help="screen updates per second (default 4; 1 to 30)")
    run.add_argument("script", metavar="SCRIPT", help="the training script")
    run.add_argument("args", metavar="ARGS", nargs=argparse.REMAINDER, help="arguments for the script")

    watch = commands.add_parser("watch", help="show every GPU and its processes (NVML)",
                                description="Show every NVIDIA GPU and the processes on it, as NVML reports them.")
    watch.add_argument("--once", action="store_true", help="print one reading and exit")
    watch.add_argument("--json", action="store_true", help="with --once: print the reading as JSON")
    return parser


def _run(options: argparse.Namespace) -> int:
    from .launch import ScriptNotFound, check_script, run_script
    from .telemetry import hub as hubs
    from .telemetry.jsonl import MetricsFile
    from .telemetry.progress import ProgressLine

    try:
        check_script(options.script)
    except ScriptNotFound as exc:
        print(f"gputui: error: {exc}", file=sys.stderr)
        return 2
    if not options.headless and not (sys.stdin.isatty() and sys.stdout.isatty()):
        print("gputui: error: the TUI needs a terminal; use `gputui run --headless` (e.g. under nohup or CI)",
              file=sys.stderr)
        return 2
    hub = hubs.Hub(hubs.Overrides(
        memory_budget=options.memory_budget, gpu_memory_limit=options.gpu_memory_limit,
        memory_history=options.memory_history, snapshot_dir=options.snapshot_dir, metrics=options.metrics))
    metrics = None
    if options.metrics:
        try:
            metrics = MetricsFile(options.metrics)
        except ValueError as exc:
            print(f"gputui: error: {exc}", file=sys.stderr)
            return 2
        hub.add_sink(metrics)
    hubs.install(hub)
    try:
        if options.headless:
            hub.add_sink(ProgressLine(sys.stdout))
            return run_script(options.script, options.args)
        return _tui(hub, options)
    finally:
        hubs.install(None)
        if metrics is not None:
            metrics.close()


def _tui(hub, options: argparse.Namespace) -> int:
    import os

    from .launch import run_script
    from .tui.app import GputuiApp
    from .tui.model import LocalSource, OutputLog
    from .tui.terminal import guarded_output

    output = OutputLog()
    with guarded_output(output.write):  # what C code writes joins the script's log
        app = GputuiApp(LocalSource(hub), script=os.path.basename(options.script),
                        runner=lambda err: run_script(options.script, options.args, err=err),
                        refresh=options.refresh, output=output)
        app.run()
    if app.return_code:  # the app itself failed: its report went to the captured output
        lines, _ = output.since(max(0, output.total - 60))
        sys.stderr.write("\n".join(lines) + "\ngputui: error: the TUI stopped on an internal error (above); "
                         "`gputui run --headless` runs without it\n")
    code = app.return_value if app.return_value is not None else 1
    lines, _ = output.since(max(0, output.total - SCRIPT_TAIL))
    if lines and not app.return_code:  # what the script said last (its save, its summary) stays visible
        print(f"gputui: {os.path.basename(options.script)} printed (last {len(lines)} lines; l in the TUI shows all):")
        print("\n".join(lines))
    if app.view.failure:
        sys.stderr.write(app.view.failure if app.view.failure.endswith("\n") else app.view.failure + "\n")
    thread = app.training_thread
    if thread is not None and thread.is_alive():
        # Quit while the script still runs: nothing more to wait for, and joining it would hang.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _watch(options: argparse.Namespace) -> int:
    if not options.once:
        print("gputui: error: the interactive watch screen is not built yet; use --once", file=sys.stderr)
        return 2
    from .watch import run_once

    return run_once(options.json, sys.stdout, sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    options = _parser().parse_args(argv)
    if options.command == "run":
        return _run(options)
    if options.command == "watch":
        return _watch(options)
    _parser().print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
