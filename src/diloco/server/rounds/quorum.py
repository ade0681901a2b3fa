"""Quorum rounds' clock-side state for one barrier (``--quorum``, ``--grace``): the round's quorum
size, when it was reached, the grace window in force, and the recent arrival offsets the
``auto`` window is derived from. No I/O: times come from the injected clock; the aggregator
arms a timer for ``deadline()`` (server/rounds/sync_aggregator.py).

The maths is ``core/grace.py``'s; the rules are docs/design/server-mode.md, "Quorum rounds".
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

from diloco.core.grace import grace_window, quorum_size


@dataclass(frozen=True)
class LateMerge:
    """An upload counted in a round after the round it was computed against closed."""

    round: int  # counted in
    base: int  # computed against
    worker_id: str
    weight: float  # the staleness factor it was scaled by


class QuorumRule:
    """When a sync round may close early, and how late work may still count."""

    ROUNDS = 8  # rounds of arrival offsets the auto window looks at
    LATE_SHOWN = 16  # late merges kept for status

    def __init__(
        self,
        quorum: int | float,
        grace: float | None,
        *,
        floor: float,
        ceiling: float,
        max_lateness: int,
        clock: Callable[[], float],
    ) -> None:
        self.quorum = quorum
        self.grace = grace  # None: auto
        self.floor, self.ceiling = floor, ceiling
        self.max_lateness = max_lateness
        self.clock = clock
        self.k = 0  # this round's quorum size, fixed when it opens
        self.reached_at: float | None = None  # when the k-th contribution arrived
        self.window: float | None = None  # the grace in force, fixed at the k-th arrival
        self._arrivals: list[float] = []  # this round's arrival times, before the k-th
        #: round -> (when its quorum was reached, offsets of arrivals counted against it).
        self._rounds: OrderedDict[int, tuple[float, list[float]]] = OrderedDict()
        self.late: deque[LateMerge] = deque(maxlen=self.LATE_SHOWN)
        self.late_total = 0

    def open(self, round_: int, expected: int, min_workers: int, already: int = 0) -> None:
        """``round_`` opens with ``expected`` workers, ``already`` of its contributions in (a
        round 0 fills before it opens): its quorum size is fixed now."""
        self.k = quorum_size(self.quorum, expected, min_workers)
        self.reached_at = self.window = None
        now = self.clock()
        self._arrivals = [now] * already
        if already >= self.k:
            self._reach(round_, now)

    def arrived(self, round_: int, count: int, base: int) -> None:
        """A contribution computed against ``base`` was counted in ``round_``, its ``count``-th."""
        now = self.clock()
        # Each arrival is one offset: a late one's against the quorum of the round it missed
        # (what waiting for it would have cost), an on-time one's against its own round's.
        if base < round_:
            missed = self._rounds.get(base)
            if missed is not None:
                missed[1].append(now - missed[0])
        elif self.reached_at is not None:
            self._rounds[round_][1].append(now - self.reached_at)
        else:
            self._arrivals.append(now)
        if self.reached_at is None and count >= self.k > 0:  # k is 0 until the round opens
            self._reach(round_, now)

    def _reach(self, round_: int, now: float) -> None:
        self.reached_at = now
        # Arrivals before the quorum count too (offsets <= 0): the window measures how spread
        # out the workers of recent rounds were around it, so rounds whose last worker is dead
        # or frozen, and never arrives, still say how long the others took.
        self._rounds[round_] = (now, [t - now for t in self._arrivals])
        while len(self._rounds) > self.ROUNDS:
            self._rounds.popitem(last=False)
        if self.grace is not None:
            self.window = self.grace
        else:
            self.window = grace_window(self.offsets(), self.floor, self.ceiling)

    def merged_late(self, merge: LateMerge) -> None:
        self.late.append(merge)
        self.late_total += 1

    def deadline(self) -> float | None:
        """When the round may close with what it has (None: its quorum is not in yet)."""
        if self.reached_at is None or self.window is None:
            return None
        return self.reached_at + self.window

    def due(self) -> bool:
        deadline = self.deadline()
        return deadline is not None and self.clock() >= deadline

    def offsets(self) -> list[float]:
        """The recent offsets, oldest round first (status, tests)."""
        return [x for _, xs in self._rounds.values() for x in xs]
