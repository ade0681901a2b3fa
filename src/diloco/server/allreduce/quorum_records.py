"""All-reduce mode's quorum records (``server/allreduce/quorum_book.py`` keeps them): where a
quorum starts (``choose``, pure), the states the run agreed (``Agreed``) and what a restarted
server learns of them (``learn``), an open quorum and its outcomes, and an ended one. What
``GET /status`` shows of them is ``server/observe/records.py``'s ``QuorumStatus``."""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from diloco.wire.messages import QuorumAsk, QuorumOutcome


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


def learn(asks: Sequence[QuorumAsk]) -> tuple[int, str] | None:
    """What a server without records (it restarted) takes as the run's agreed state from the
    members of its first quorum (by rank): the (round, hash) more than half of them hold;
    without such a majority the most common, ties to the lower round (a member claiming rounds
    the run never reached claims higher ones), then to the lowest rank. None: nobody holds
    state."""
    held = [(a.round, a.hash) for a in asks if a.holds]
    if not held:
        return None
    counts = Counter(held)
    most = max(counts.values())
    if 2 * most > len(asks):
        return next(s for s in held if counts[s] == most)
    lowest = min(r for (r, _), c in counts.items() if c == most)
    return next(s for s in held if counts[s] == most and s[0] == lowest)


AGREED_KEPT = 100_000
"""Agreed states remembered (about 150 bytes each: 15 MB at most). A claim older than all of
them is refused like one never agreed: the worker then presents no state and receives the
run's, which is what an older state would have got it anyway."""


class Agreed:
    """The (round, hash) states the run agreed on: each completed quorum's majority state, the
    state a strict majority of a discarded quorum's members reported after its commit point (the
    two generals), or what a restarted server learned (``learn``). Only these may be a quorum's
    source."""

    def __init__(self) -> None:
        self._how: OrderedDict[tuple[int, str], str] = OrderedDict()
        self.latest: tuple[int, str] | None = None  # the highest round agreed

    def add(self, state: tuple[int, str], how: str) -> bool:
        """Record ``state`` (``how`` it was agreed, for the log); False if it already was."""
        if state in self._how:
            return False
        self._how[state] = how
        while len(self._how) > AGREED_KEPT:
            self._how.popitem(last=False)
        if self.latest is None or state[0] >= self.latest[0]:
            self.latest = state
        return True

    def __contains__(self, state: object) -> bool:
        return state in self._how

    def __len__(self) -> int:
        return len(self._how)


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
