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
    run.add_argument("script", metavar="SCRIPT", help="the training script")
    run.add_argument("args", metavar="ARGS", nargs=argparse.REMAINDER, help="arguments for the script")
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
    if not options.headless:
        print("gputui: error: the TUI is not built yet; use `gputui run --headless SCRIPT`", file=sys.stderr)
        return 2
    hub = hubs.Hub(hubs.Overrides(memory_budget=options.memory_budget, metrics=options.metrics))
    hub.add_sink(ProgressLine(sys.stdout))
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
        return run_script(options.script, options.args)
    finally:
        hubs.install(None)
        if metrics is not None:
            metrics.close()


def main(argv: Sequence[str] | None = None) -> int:
    options = _parser().parse_args(argv)
    if options.command == "run":
        return _run(options)
    _parser().print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
