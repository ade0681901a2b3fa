"""All-reduce mode: who the next quorum does without. Members of a failed quorum that went
silent, left out of the next quorum before the heartbeat timeout evicts them (``Suspects``), and
workers left out although they ask (``LeftOut``: below).

A quorum waits for every live worker. When a member dies inside a collective, the others'
collective fails within milliseconds and they ask again; without this the next quorum would
wait for the dead member's eviction (``--heartbeat-timeout``, two minutes by default). A failed
collective is strong evidence, and heartbeats confirm it: a member of a discarded quorum that has
neither reported, asked again, nor sent a heartbeat since the discard, for two of its own
heartbeat intervals (it tells its interval at registration) plus a margin, is a suspect. The next
quorum forms without suspects; a suspect is not evicted, and counts again as soon as the server
hears from it (it then receives the state at its next quorum, keeping its progress on top). A
worker without heartbeats (interval 0) is never a suspect: only its eviction leaves it out.

Pure state with an injected clock, like ``server/allreduce/quorum_book.py``, which owns the
instance.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

log = logging.getLogger(__name__)

MARGIN_S = 0.5
"""Added to two heartbeat intervals: a heartbeat in flight, the server's tick."""

HeartbeatOf = Callable[[str], tuple[float, float] | None]
"""``worker -> (last seen, heartbeat interval)``; None for a worker no longer registered."""


class Suspects:
    """Members of discarded quorums not heard from since, by the time of the discard."""

    def __init__(self, heartbeat_of: HeartbeatOf) -> None:
        self._heartbeat_of = heartbeat_of
        self._since: dict[str, float] = {}

    def failed(self, members: Iterable[str], heard: Iterable[str], now: float) -> None:
        """A quorum of ``members`` was discarded at ``now``; ``heard`` reported to it."""
        spoke = set(heard)
        for member in members:
            if member not in spoke:
                self._since.setdefault(member, now)

    def heard(self, worker: str) -> None:
        """The worker asked, reported or left: it is no longer suspected."""
        self._since.pop(worker, None)

    def silent(self, now: float) -> set[str]:
        """Suspects that stayed silent past their grace: the next quorum does not wait for
        them. A suspect seen since the discard (a heartbeat) is forgiven here."""
        out = set()
        for worker, since in list(self._since.items()):
            beat = self._heartbeat_of(worker)
            if beat is None:
                del self._since[worker]
                continue
            last_seen, interval = beat
            if last_seen > since:
                del self._since[worker]  # alive: its collective may just be slower to fail
            elif interval > 0 and now >= since + 2 * interval + MARGIN_S:
                out.add(worker)
        return out

    def __contains__(self, worker: object) -> bool:
        return worker in self._since


def quiet(heartbeat_of: HeartbeatOf, worker: str, since: float, now: float) -> float | None:
    """When ``worker`` went silent, if it has sent nothing since ``since`` or its last
    heartbeat after it, whichever is later, for two of its heartbeat intervals plus the margin:
    the suspects' rule, for a member missing from a quorum whose others all reported (it died
    after the commit point, before its report). None while it may still speak, for a worker
    that left (its leaving discarded the quorum) and for one without heartbeats."""
    beat = heartbeat_of(worker)
    if beat is None:
        return None
    last_seen, interval = beat
    start = max(since, last_seen)
    return start if interval > 0 and now >= start + 2 * interval + MARGIN_S else None


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
