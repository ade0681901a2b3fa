"""All-reduce mode: members of a failed quorum that went silent, left out of the next quorum
before the heartbeat timeout evicts them (``Suspects``). Workers left out although they ask are
``leaves.py``'s.

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
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from diloco.server.allreduce.quorum_records import QuorumRecord

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

    def gone_after_reports(self, q: QuorumRecord, now: float) -> bool:
        """An open quorum some members reported to, all ok: True when each member that did not
        went silent since the first report (``quiet``: it died after the commit point, before
        its report), and then they are suspects; the quorum may complete with the reports
        present."""
        assert q.first_report is not None
        if not all(o.ok for o in q.outcomes.values()):
            return False
        missing = q.missing()
        gone = {w: quiet(self._heartbeat_of, w, q.first_report, now) for w in missing}
        if any(since is None for since in gone.values()):
            return False
        log.warning(
            "quorum %s: %s silent since the first report %.2f s ago: completed with the "
            "reports of %s; they are left out of the next quorum until heard from",
            q.id,
            ", ".join(missing),
            now - q.first_report,
            ", ".join(sorted(q.outcomes)),
        )
        for worker, since in gone.items():
            assert since is not None
            self.failed([worker], (), since)  # silent since then: a suspect now
        return True


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
