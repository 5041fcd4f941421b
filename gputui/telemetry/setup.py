"""One way to open a process's telemetry: the hub, its sinks and its socket, closed in order.

`gputui run` opens it around the script with the command line's settings; `fit()` under plain
`python` opens one for the rest of the process. Either way the engine only publishes into the
hub that is installed.
"""

from __future__ import annotations

import atexit
import contextlib
import os
from collections.abc import Iterator
from typing import TextIO

from . import hub as hubs
from .jsonl import MetricsFile
from .progress import ProgressLine
from .run import RunSummary, launched_rank
from .server import serve


@contextlib.contextmanager
def opened(
    overrides: hubs.Overrides | None = None, *, progress: TextIO | None = None, attachable: bool = True
) -> Iterator[hubs.Hub]:
    """Install a hub for the duration: a metrics file if `overrides.metrics` names one (ValueError
    if it cannot be written), a progress line on `progress`, a socket to attach to. On the way
    out: the socket goes first (no client sees a half-closed run), then the hub, then the file."""
    hub = hubs.Hub(overrides)
    metrics = MetricsFile(hub.overrides.metrics) if hub.overrides.metrics else None
    if metrics is not None:
        hub.add_sink(metrics)
    if progress is not None and not launched_rank():  # under torchrun, one progress line: rank 0's
        hub.add_sink(ProgressLine(progress))
    hubs.install(hub)
    server = serve(hub) if attachable else None
    try:
        yield hub
    finally:
        hub.finish()
        if server is not None:
            server.close()
        hubs.install(None)
        hub.close()
        if metrics is not None:
            metrics.close()


def for_process(progress: TextIO | None) -> hubs.Hub:
    """The hub fit() publishes into when nothing installed one (plain `python script.py`): opened
    once, kept for later fits, closed at exit."""
    current = hubs.current()
    if current is not None:
        return current
    stack = contextlib.ExitStack()
    hub = stack.enter_context(opened(progress=progress))
    atexit.register(stack.close)
    return hub


class MetricsSink:
    """fit's `metrics=`: a metrics file for one run, opened at once (ValueError if it cannot be, before
    anything starts), fed while the run is entered, closed after it (or by close(), when the run never
    starts). No path: nothing to write."""

    def __init__(self, hub: hubs.Hub, path: str | os.PathLike[str] | None) -> None:
        self.hub = hub
        self.file = MetricsFile(path) if path is not None else None

    def __enter__(self) -> None:
        if self.file is not None:
            self.hub.add_sink(self.file)
            if self.hub.info is not None and self.hub.summary is None:  # a run going on: this file's first line
                self.hub.tell(self.file, "on_start", self.hub.info)

    def end(self, summary: RunSummary) -> None:
        """This run's part ended: the file's last line (the process's run goes on; continuity.py)."""
        if self.file is not None:
            self.hub.tell(self.file, "on_end", summary)

    def __exit__(self, *exc: object) -> None:
        if self.file is not None:
            self.hub.remove_sink(self.file)
        self.close()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
