"""All-reduce mode: the server's count of the members the quorums' checks left out
(``worker/allreduce/average_checks.py``; each member's ``QuorumOutcome.excluded``).

Contract:

- ``note``: a member of a quorum names the members its checks left out; counted once per quorum
  (every member reaches the same verdict, so the first report stands for all), names that are
  not members ignored, logged once. Returns the workers that reached ``EXCLUSIONS_LEFT_OUT``
  rounds in a row: ``server/allreduce/quorum_book.py`` leaves them out until they register
  again (``leaves.LeftOut.exclude``).
- Rounds in a row go back to 0 when a completed quorum admitted the worker (``completed``) or
  it registered again (``registered``); the totals stay (``GET /status`` ``excluded_rounds``,
  ``diloco_members_excluded_total``).

Pure state; memory is bounded (``EXCLUSIONS_KEPT``) whatever ids the workers name.
"""

from __future__ import annotations

import logging
from collections import Counter

from diloco.server.allreduce.leaves import EXCLUSIONS_LEFT_OUT
from diloco.server.observe.records import WorkerExclusions

log = logging.getLogger(__name__)

EXCLUSIONS_KEPT = 4096
"""Workers whose exclusion counts are kept (the oldest forgotten first): a bound on memory
that an authenticated worker inventing ids cannot grow."""


class Exclusions:
    """Members left out by the checks: rounds per worker, rounds in a row, the last quorum's."""

    def __init__(self) -> None:
        self.rounds: Counter[str] = Counter()
        self._in_a_row: Counter[str] = Counter()
        self.last: tuple[str, ...] = ()  # the members the last quorum with exclusions left out
        self._counted: str | None = None  # the quorum they were counted for (each quorum once)

    def note(self, qid: str, members: tuple[str, ...], excluded: tuple[str, ...]) -> list[str]:
        """Count the members of quorum ``qid`` its checks left out; those now excluded
        ``EXCLUSIONS_LEFT_OUT`` rounds in a row."""
        if self._counted == qid:
            return []
        named = tuple(w for w in members if w in excluded)
        if not named:
            return []
        self._counted = qid
        self.last = named
        for w in named:
            self.rounds[w] += 1
            self._in_a_row[w] += 1
        for counts in (self.rounds, self._in_a_row):
            while len(counts) > EXCLUSIONS_KEPT:
                del counts[next(iter(counts))]
        log.warning(
            "quorum %s left out %s (a non-finite pseudo-gradient, a norm far above the "
            "quorum's median, or a weight out of bounds; the members' logs say which)",
            qid,
            ", ".join(f"{w} ({self._in_a_row[w]} in a row)" for w in named),
        )
        return [w for w in named if self._in_a_row[w] >= EXCLUSIONS_LEFT_OUT]

    def completed(self, qid: str, members: tuple[str, ...]) -> None:
        """Quorum ``qid`` completed: the members its checks admitted start their run again."""
        for w in members:
            if not (self._counted == qid and w in self.last):
                self._in_a_row.pop(w, None)

    def registered(self, worker: str) -> None:
        """The worker registered (again): its exclusions in a row start again."""
        self._in_a_row.pop(worker, None)

    def in_a_row(self, worker: str) -> int:
        """Quorums in a row whose checks left the worker out."""
        return self._in_a_row.get(worker, 0)

    def public(self) -> tuple[WorkerExclusions, ...]:
        """Per worker, by id: rounds in all and in a row (``GET /status``)."""
        return tuple(
            WorkerExclusions(w, n, self.in_a_row(w)) for w, n in sorted(self.rounds.items())
        )
