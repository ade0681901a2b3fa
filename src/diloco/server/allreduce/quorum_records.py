"""All-reduce mode's quorum records (``server/allreduce/quorum_book.py`` keeps them): where a
quorum starts (``choose``, pure), an open quorum and its outcomes (``QuorumRecord``: the
assignment it hands each member, the state most members report), and the quorums that ended
(``Finished``). The states the run agreed on, which ``choose`` is told, are ``agreement.py``'s;
the requests waiting for a quorum are ``waiting.py``'s. What ``GET /status`` shows of them is
``server/observe/records.py``'s ``QuorumStatus``."""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from diloco.server.errors import ApiError, bad_request, conflict
from diloco.wire.messages import Assignment, QuorumAsk, QuorumOutcome, Rendezvous

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Choice:
    """Where a quorum starts: the state ``round`` and ``hash``, the rank that holds them
    (``source``) and the ranks that must receive them (``resync``)."""

    round: int
    hash: str
    source: int
    resync: tuple[int, ...]


def choose(
    asks: Sequence[QuorumAsk],
    agreed: tuple[int, str] | None = None,
    acceptable: Callable[[int, str], bool] | None = None,
) -> Choice:
    """The start of a quorum whose members (by rank) asked with ``asks``; at least one holds an
    ``acceptable`` state (default: any). ``agreed``: the last state a quorum completed with,
    preferred when a member holds it (a member whose hash diverged then loses even where it is
    not outnumbered). A member holding a state that is not acceptable is never the source: it
    receives the chosen state like one holding none."""
    ok = acceptable or (lambda r, h: True)
    holders = [(rank, a) for rank, a in enumerate(asks) if a.holds and ok(a.round, a.hash)]
    assert holders, "a quorum needs a member with an acceptable state"
    top = max(a.round for _, a in holders)
    at_top = [(rank, a.hash) for rank, a in holders if a.round == top]
    counts = Counter(h for _, h in at_top)
    if agreed is not None and agreed[0] == top and agreed[1] in counts:
        chosen = agreed[1]
    else:  # the most common; among equals the lowest rank's
        chosen = next(h for _, h in at_top if counts[h] == max(counts.values()))
    source = next(rank for rank, h in at_top if h == chosen)
    resync = tuple(
        rank for rank, a in enumerate(asks) if not (a.holds and a.round == top and a.hash == chosen)
    )
    return Choice(top, chosen, source, resync)


FINISHED_KEPT = 256
"""Ended quorums remembered (and the states they made, ``agreement.py``), so a late or retried
outcome gets its answer and not a 404."""


@dataclass
class QuorumRecord:
    """An open quorum and the outcomes reported so far."""

    id: str
    members: tuple[str, ...]  # by rank
    start: Choice
    save: bool
    save_requested: bool  # an operator's request rides on it (renewed if it is discarded)
    deadline: float
    outcomes: dict[str, QuorumOutcome] = field(default_factory=dict)
    first_report: float | None = None  # when the first outcome came (a death after commit)

    def assignment(self, rank: int, meet: Rendezvous, timeout: float, made_by: str) -> Assignment:
        """The quorum reply of the member at ``rank``."""
        start = self.start
        return Assignment(
            quorum_id=self.id,
            rank=rank,
            size=len(self.members),
            members=self.members,
            round=start.round,
            hash=start.hash,
            source=start.source,
            resync=start.resync,
            rendezvous=meet,
            timeout=timeout,
            save=self.save,
            made_by=made_by,
        )

    def check(self, outcome: QuorumOutcome) -> None:
        """409 ``not_a_member``; 400 for an ok outcome at another round than the quorum's + 1
        (a step) or the quorum's (none)."""
        check_member(outcome.worker_id, self.id, self.members)
        start = self.start.round
        if outcome.ok and outcome.round not in (start, start + 1):
            raise bad_request(
                "bad_field",
                f"'round' must be {start + 1} (the quorum's round + 1), or {start} when no step "
                f"was taken; got {outcome.round}",
            )

    def missing(self) -> list[str]:
        """The members that have not reported, by rank."""
        return [w for w in self.members if w not in self.outcomes]

    def majority(self) -> tuple[tuple[int, str], list[str], list[str]]:
        """The state most members that reported report (ties: the lowest rank's), those that
        reported, and those of them that report another state."""
        reported = [w for w in self.members if w in self.outcomes]
        results = [(self.outcomes[w].round, self.outcomes[w].hash) for w in reported]
        counts = Counter(results)
        new_round, new_hash = next(r for r in results if counts[r] == max(counts.values()))
        assert new_round is not None
        diverged = [w for w, r in zip(reported, results, strict=True) if r != (new_round, new_hash)]
        return (new_round, new_hash), reported, diverged

    def made(self) -> dict[str, tuple[int, str]]:
        """The states members reported after applying the step (they passed the commit point)."""
        after = self.start.round + 1
        return {
            w: (o.round, o.hash)
            for w, o in self.outcomes.items()
            if o.ok and o.round is not None and o.round == after
        }


@dataclass(frozen=True)
class Ended:
    """A quorum that completed or was discarded (``reason``)."""

    members: tuple[str, ...]
    status: str  # "recorded" (it completed) or "discarded"
    reason: str
    start_round: int
    # Discarded: the states members reported ok (they passed the commit point), by worker; a
    # strict majority of the members on one makes it agreed (the two generals).
    made: dict[str, tuple[int, str]] = field(default_factory=dict)


class Finished:
    """The quorums that ended (the last ``FINISHED_KEPT``), and the ones whose rendezvous keys
    are still to go."""

    def __init__(self) -> None:
        self._ended: OrderedDict[str, Ended] = OrderedDict()
        self._to_forget: list[str] = []

    def get(self, qid: str) -> Ended | None:
        return self._ended.get(qid)

    def of(self, outcome: QuorumOutcome) -> Ended:
        """The ended quorum an outcome is reported to: 404 ``unknown_quorum`` for an id this
        server never formed (it restarted: ask for a new quorum), 409 ``not_a_member``."""
        qid = outcome.quorum_id
        ended = self._ended.get(qid)
        if ended is None:
            raise ApiError(
                404,
                "unknown_quorum",
                f"no quorum {qid!r} here (the server restarted?): ask for a new quorum",
            )
        check_member(outcome.worker_id, qid, ended.members)
        return ended

    def add(self, qid: str, ended: Ended, forget: Callable[[str], object] | None) -> None:
        """Quorum ``qid`` ended. A discarded quorum's members may still be connecting: its keys
        go (``forget``) once a later quorum completes (by then each of them has timed out or
        moved on)."""
        self._ended[qid] = ended
        while len(self._ended) > FINISHED_KEPT:
            self._ended.popitem(last=False)
        self._to_forget.append(qid)
        if ended.status == "recorded" and forget is not None:
            for gone in self._to_forget:
                try:
                    forget(gone)
                except Exception:  # the store is a cache of connection details, not state
                    log.exception("could not drop the rendezvous keys of quorum %s", gone)
            self._to_forget.clear()


def check_member(worker: str, qid: str, members: tuple[str, ...]) -> None:
    """409 ``not_a_member`` unless ``worker`` is one of quorum ``qid``'s ``members``."""
    if worker not in members:
        raise conflict("not_a_member", f"worker {worker!r} is not a member of quorum {qid!r}")


def failure(outcome: QuorumOutcome) -> str:
    """Why a member's failed outcome discards its quorum, for the log and the late reports."""
    stage = f" at {outcome.stage}" if outcome.stage else ""
    return f"member {outcome.worker_id} failed{stage}: {outcome.error or 'no reason given'}"
