"""All-reduce mode: workers the next quorums do without although they ask (``LeftOut``). A
worker is left out when it is blamed for quorums failing in a row at a join or a collective (for
a while, doubled each time it is left out again before it completes a quorum), or when the
quorums' checks excluded its contribution ``EXCLUSIONS_LEFT_OUT`` rounds in a row (until it
registers again). Its quorum requests are refused meanwhile (409 ``left_out``).

Pure state with an injected clock (times are passed in), like ``suspects.py``;
``server/allreduce/quorum_book.py`` owns the instance and decides when a quorum failed, completed
or excluded a member.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

from diloco.server.observe.records import LeftOutStatus

log = logging.getLogger(__name__)

BLAMED_STAGES = ("", "join", "resync", "average", "commit")
"""Where a member's failure counts towards leaving one member out (``LeftOut.failed``): a
connection or a collective broke. A failed check of the average ("check") is the checks'
business (``QuorumOutcome.excluded``)."""
BLAME_AFTER = 2
"""Quorums discarded in a row (a join or a collective failed) before a member of the last is
left out."""
LEAVE_CAP = 32
"""The longest leave, in first leaves: a worker left out again without completing a quorum in
between stays out twice as long as the time before."""
EXCLUSIONS_LEFT_OUT = 3
"""Rounds in a row whose checks left a worker's contribution out (``QuorumOutcome.excluded``)
before it is left out of quorums until it registers again."""


@dataclass(frozen=True)
class Leave:
    """Why a worker is left out of quorums, and until when (``inf``: until it registers
    again, ``rejoin``)."""

    reason: str
    until: float
    rejoin: bool = False


class LeftOut:
    """Workers the next quorums do without although they ask: blamed for failed joins or
    collectives, or excluded by the checks too often.

    A failed join fails on every member, so one failure blames nobody. When ``BLAME_AFTER``
    quorums are discarded in a row (whatever their members: a quorum formed without a member
    slower to ask again must not start the count over), the member of the last whose last
    completed quorum is oldest is left out (one that never completed one first: a newcomer behind a firewall);
    among equals the one blamed least, then the next in turn. Workers blamed since the last
    completed quorum that are not among the members failing again were blamed wrongly: their
    leave ends (so a tie at a fresh start tries each candidate once, and cannot livelock). A
    leave lasts ``base`` seconds, doubled each time the worker is left out again before it
    completes a quorum (capped at ``LEAVE_CAP * base``); then it is tried again."""

    def __init__(self, base: float) -> None:
        self.base = base
        self._failed = 0  # quorums discarded in a row
        self._last_done: dict[str, float] = {}
        self._strikes: dict[str, int] = {}  # leaves since its last completed quorum
        self._blamed: dict[str, int] = {}
        self._turn = 0
        self._leaves: dict[str, Leave] = {}
        self._since_done: list[str] = []  # blamed since the last completed quorum

    def completed(self, members: Iterable[str], now: float) -> None:
        for member in members:
            self._last_done[member] = now
            self._strikes.pop(member, None)
        self._failed = 0
        self._since_done.clear()

    def failed(self, members: tuple[str, ...], now: float) -> tuple[str, Leave] | None:
        """A quorum of ``members`` was discarded (a join or collective failed): the member left
        out because of it, if any."""
        self._failed += 1
        if self._failed < BLAME_AFTER or len(members) < 2:
            return None
        self._failed = 0
        for wrongly in [w for w in self._since_done if w not in members]:
            self._since_done.remove(wrongly)  # the others fail without it too
            self._strikes[wrongly] = max(0, self._strikes.get(wrongly, 1) - 1)
            leave = self._leaves.get(wrongly)
            if leave is not None and not leave.rejoin:
                del self._leaves[wrongly]
                log.info("worker %s is tried again: quorums fail without it too", wrongly)
        never = -float("inf")
        oldest = min(self._last_done.get(m, never) for m in members)
        tied = [m for m in members if self._last_done.get(m, never) == oldest]
        least = min(self._blamed.get(m, 0) for m in tied)
        tied = [m for m in tied if self._blamed.get(m, 0) == least]
        worker = tied[self._turn % len(tied)]
        self._turn += 1
        self._blamed[worker] = self._blamed.get(worker, 0) + 1
        strikes = self._strikes[worker] = self._strikes.get(worker, 0) + 1
        span = self.base * min(2 ** (strikes - 1), LEAVE_CAP)
        done = "never completed one" if oldest == never else "completed one longest ago"
        leave = Leave(
            f"{BLAME_AFTER} quorums failed in a row (join or collective), the last of "
            f"{', '.join(members)}, and of them it {done}; tried again after {span:g} s",
            now + span,
        )
        self._leaves[worker] = leave
        self._since_done.append(worker)
        log.warning("worker %s left out of quorums: %s", worker, leave.reason)
        return worker, leave

    def exclude(self, worker: str) -> Leave:
        """Left out until it registers again (``EXCLUSIONS_LEFT_OUT`` exclusions in a row)."""
        leave = Leave(
            f"its contribution was excluded {EXCLUSIONS_LEFT_OUT} rounds in a row; register "
            "again and join with weight 0 (receiving the run's state)",
            float("inf"),
            rejoin=True,
        )
        self._leaves[worker] = leave
        log.warning("worker %s left out of quorums: %s", worker, leave.reason)
        return leave

    def registered(self, worker: str) -> None:
        """It registered again: a leave until then ends (a blame's runs its time)."""
        leave = self._leaves.get(worker)
        if leave is not None and leave.rejoin:
            del self._leaves[worker]

    def of(self, worker: str, now: float) -> Leave | None:
        """Its leave, if still running (one that ran out is dropped: on probation)."""
        leave = self._leaves.get(worker)
        if leave is not None and now >= leave.until:
            del self._leaves[worker]
            return None
        return leave

    def current(self, now: float) -> dict[str, Leave]:
        return {w: leave for w in list(self._leaves) if (leave := self.of(w, now)) is not None}

    def public(self, now: float) -> tuple[LeftOutStatus, ...]:
        """The leaves running, by worker (``GET /status`` ``left_out``)."""
        return tuple(
            LeftOutStatus(w, leave.reason, None if leave.rejoin else leave.until - now)
            for w, leave in sorted(self.current(now).items())
        )
