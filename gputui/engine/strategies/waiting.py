"""Waiting for the other ranks in fit's exchange, bounded and said. The wait runs in slices, so
between two of them a rank notices a stop (Ctrl-C, SIGTERM, the stop control), says once it has
waited past a threshold (a `rank_waiting` event naming the ranks that have not arrived), sees a run
that ended on one rank and went on on another (the script's loops of unequal length), and gives up
after the run's `rank_timeout` instead of the transport's own (gloo's is 30 minutes)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from ...units import seconds_from_env
from ..result import FitError
from .group import abandon, lost_ranks, store

SLICE_S = 0.25
"""How long one slice of a wait lasts: a signal's handler runs between two (the wait holds no GIL)."""

WAITING_S = 60.0
"""A wait this long is said (screen, `gputui jobs`, progress line): far above any step's, far below
the timeout. GPUTUI_RANK_WAITING_S sets another."""

STOP_GRACE_S = 1.0
"""After a stop, a wait goes on this long, or two steps' time if longer: a rank that is alive reaches
the exchange within a step, and then every rank stops together at the next one."""

INSIDE_GRACE_S = 5.0
"""The same for a wait inside the synced backward (DDP's last bucket): an alive rank reaches it only at
the end of its step, which one slow step (a recompile, the script's I/O) can stretch well past two."""

ROLL_S = 1.0
"""How often the roll reads who has arrived (and Apart what the closing ranks said)."""

APART_AFTER_S = 2.0
"""A wait this long starts Apart: longer than a step's usual wait, short enough that loops of unequal
length are said in seconds."""

CLOSED, WENT_ON = "gputui/closed", "gputui/went-on"
"""Apart's keys in the job's store: "rank steps seq" of a rank closing after `steps` at closing exchange
`seq`, and of a rank that went on past them."""

_SLICE_ENDED = "Operation timed out!"  # Work.wait(timeout)'s word for a slice over, the collective still on


def waiting_threshold() -> float:
    """The threshold of a `rank_waiting`, in seconds."""
    return seconds_from_env("GPUTUI_RANK_WAITING_S", WAITING_S)


class Roll:
    """Who has arrived at exchange `seq`: each rank waiting long writes it in the job's store (torchrun's
    agent keeps it, answering while a rank is stopped), so a rank not there has not reached the
    exchange. Read in a thread of its own: a store served by a stopped rank would block its reader."""

    def __init__(self, rank: int, world: int, seq: int) -> None:
        self.rank, self.world, self.seq = rank, world, seq
        self.missing: list[int] | None = None  # None: not read yet
        self.done = threading.Event()
        threading.Thread(target=self._run, name="gputui-roll", daemon=True).start()

    def _key(self, rank: int) -> str:
        return f"gputui/waiting/{rank}"

    def _run(self) -> None:
        try:
            s = store()
            s.set(self._key(self.rank), str(self.seq))
            while not self.done.is_set():
                keys = [(r, self._key(r)) for r in range(self.world) if r != self.rank]
                self.missing = [r for r, k in keys if not s.check([k]) or s.get(k).decode() != str(self.seq)]
                self.done.wait(ROLL_S)
        except Exception:  # no store to read (a group made from a file, say): the fallback names them all
            return

    def named(self) -> list[int]:
        """The ranks that have not arrived, as last read; every other rank until the roll has read it."""
        if self.missing:
            return list(self.missing)
        return [r for r in range(self.world) if r != self.rank]


class Apart:
    """Whether the run ended on one rank and went on on another: a closing rank says it in the job's store
    (CLOSED); a rank waiting in the step after the same steps reads it, says it went on (WENT_ON) and ends;
    the closing ranks read that and end too. Two keys, a read a second per waiting rank whatever the job's
    size; in a thread of its own, as the roll."""

    def __init__(self, rank: int, seq: int, steps: int, closing: bool) -> None:
        self.rank, self.seq, self.steps, self.closing = rank, seq, steps, closing
        self.ended: tuple[int, int] | None = None  # (the other rank, its steps)
        self.done = threading.Event()
        threading.Thread(target=self._run, name="gputui-apart", daemon=True).start()

    def _run(self) -> None:
        try:
            s = store()
            if self.closing:
                s.set(CLOSED, f"{self.rank} {self.steps} {self.seq}")
            while self.ended is None and not self.done.is_set():
                self._read(s)
                self.done.wait(ROLL_S)
            if self.closing and self.ended is None:  # closed together: a later part's first wait must not read it
                s.set(CLOSED, f"{self.rank} -1 {self.seq}")  # overwritten, not deleted: a reader between its
                # check and its get would wait in the get until the store's timeout
        except Exception:  # no store to read (a group made from a file, say): the wait goes on without it
            return

    def _read(self, s: Any) -> None:
        if self.closing:
            if s.check([WENT_ON]):
                rank, steps, seq = map(int, s.get(WENT_ON).split())
                if seq == self.seq:  # past this closing exchange (an older one's key says another)
                    self.ended = (rank, steps)
        elif s.check([CLOSED]):
            rank, steps, seq = map(int, s.get(CLOSED).split())
            if steps == self.steps:  # it closed after the steps this rank has done (an older key: fewer)
                s.set(WENT_ON, f"{self.rank} {self.steps} {seq}")
                self.ended = (rank, steps)

    def read_again(self) -> tuple[int, int] | None:
        """`ended` after one more read (the other rank may have read it first and left), ROLL_S at most."""

        def read() -> None:
            with contextlib.suppress(Exception):
                self._read(store())

        reader = threading.Thread(target=read, name="gputui-apart", daemon=True)
        reader.start()
        reader.join(ROLL_S)
        return self.ended


class Waiter:
    """How a rank waits for its exchange's collective (`wait(work, seq)`)."""

    def __init__(
        self,
        rank: int,
        world: int,
        *,
        timeout_s: float,
        stop_asked: Callable[[], str | None],
        said: Callable[[list[int], float], None],
        unanswered: Callable[[list[int], float, str | None], FitError],
        ended: Callable[[int, int, bool], FitError],
        steps: Callable[[], int],
    ) -> None:
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        self.threshold_s = waiting_threshold()
        self.stop_asked, self.said, self.unanswered = stop_asked, said, unanswered
        self.ended, self.steps = ended, steps  # the error of a run ended apart (Apart), the steps done
        self.closing = False  # the wait under way is the run's closing exchange
        self._last_start: float | None = None
        self._period = 0.0  # between the last two exchanges: about a step

    def wait(self, work: Any, seq: int, inside: bool = False) -> None:
        """Wait for `work`, exchange `seq` (or inside the synced backward: a longer grace after a stop)."""
        start = time.monotonic()
        if self._last_start is not None:
            self._period = start - self._last_start
        self._last_start = start
        stopped_at: float | None = None
        roll: Roll | None = None
        apart: Apart | None = None
        next_said = self.threshold_s
        try:
            while True:
                try:
                    work.wait(timedelta(seconds=SLICE_S))
                    return
                except RuntimeError as exc:
                    if str(exc) != _SLICE_ENDED:  # the transport's own timeout, or a peer gone
                        waited = time.monotonic() - start
                        if "Timed out" not in str(exc):
                            ended = apart.read_again() if apart is not None else None
                            if ended is not None:  # the other rank left, having said why
                                raise self.ended(*ended, self.closing) from None
                            raise lost_ranks(exc) from None
                        raise self.unanswered(roll.named() if roll else self._others(), waited, None) from None
                waited = time.monotonic() - start
                if roll is None and waited >= self.threshold_s / 2:  # read before it is said
                    roll = Roll(self.rank, self.world, seq)
                if apart is None and waited >= APART_AFTER_S:
                    apart = Apart(self.rank, seq, self.steps(), self.closing)
                if apart is not None and apart.ended is not None:
                    abandon(work)
                    raise self.ended(*apart.ended, self.closing)
                stop = self.stop_asked()
                if stop is not None and stopped_at is None:
                    stopped_at = time.monotonic()
                grace = max(INSIDE_GRACE_S, 4 * self._period) if inside else max(STOP_GRACE_S, 2 * self._period)
                gone = stopped_at is not None and (waited >= self.threshold_s or time.monotonic() - stopped_at >= grace)
                if gone or waited >= self.timeout_s:
                    abandon(work)
                    raise self.unanswered(roll.named() if roll else self._others(), waited, stop if gone else None)
                if waited >= next_said:
                    assert roll is not None
                    self.said(roll.named(), waited)
                    next_said += self.threshold_s
        finally:
            for reader in (roll, apart):
                if reader is not None:
                    reader.done.set()

    def _others(self) -> list[int]:
        return [r for r in range(self.world) if r != self.rank]
