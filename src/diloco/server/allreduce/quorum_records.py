"""All-reduce mode's quorum records (``server/allreduce/quorum_book.py`` keeps them): where a
quorum starts (``choose``, pure), an open quorum and its outcomes, and an ended one. What
``GET /status`` shows of them is ``server/observe/records.py``'s ``QuorumStatus``."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
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


def choose(asks: Sequence[QuorumAsk], agreed: tuple[int, str] | None = None) -> Choice:
    """The start of a quorum whose members (by rank) asked with ``asks``; at least one holds
    state. ``agreed``: the last state a quorum completed with, preferred when a member holds it
    (a member whose hash diverged then loses even where it is not outnumbered)."""
    holders = [(rank, a) for rank, a in enumerate(asks) if a.holds]
    assert holders, "a quorum needs a member with state"
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


@dataclass(frozen=True)
class Ended:
    """A quorum that completed or was discarded (``reason``)."""

    members: tuple[str, ...]
    status: str  # "recorded" (it completed) or "discarded"
    reason: str
    start_round: int
