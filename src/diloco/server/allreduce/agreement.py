"""All-reduce mode: the states the run agreed on (``Agreement``), the only ones a quorum may start
from. ``server/allreduce/quorum_book.py`` owns the instance and tells it what quorums made.

Contract:

- A state (round, hash) is agreed when a quorum completed with it (its members' majority), when
  a strict majority of a discarded quorum's members reported it after its commit point (the two
  generals: ``made_by_majority``), or when a server without records (a fresh run, a restart)
  learns it from its first quorum's members (``learn``: a strict majority, else the most common,
  ties to the lower round, then the lowest rank).
- ``refuse_unagreed``: 409 ``unagreed_state`` for a request presenting a state above round 0
  that the run never agreed on and that no member reported making (one reported by a quorum
  still open, or by a minority of a discarded one, is let in: only ``acceptable`` states are a
  source, the others receive it). A round-0 state is a worker's own start. Changes nothing.
- ``refuse_unheld``: a swarm replica's ready (``POST /swarm/ready``) where the stage agreed on
  states: 409 ``state_required`` for none presented, 409 ``unagreed_state`` for one neither
  agreed nor reported made by a quorum's member; round 0 gets no pass there. Changes nothing.
- ``made_by``: which quorum's step made a state members reported; a member whose commit point
  failed after the others' passed learns from it that its contribution is in the state it
  receives (``worker/allreduce/quorum_sync.py``, "the two generals").

Pure state; memory is bounded (``AGREED_KEPT``, ``FINISHED_KEPT``) whatever the workers send.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from diloco.server.allreduce.quorum_records import FINISHED_KEPT, Ended
from diloco.server.errors import READY_ADVICE, state_required, unagreed_state
from diloco.wire.messages import QuorumAsk, QuorumOutcome

log = logging.getLogger(__name__)

AGREED_KEPT = 100_000
"""Agreed states remembered (about 150 bytes each: 15 MB at most). A claim older than all of
them is refused like one never agreed: the worker then presents no state and receives the
run's, which is what an older state would have got it anyway."""

State = tuple[int, str]
"""A state the workers hold: (round, hash)."""


def learn(asks: Sequence[QuorumAsk]) -> State | None:
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
    # A strict majority is the one state held ``most`` times, so the ties' rule picks it too.
    lowest = min(r for (r, _), c in counts.items() if c == most)
    return next(s for s in held if counts[s] == most and s[0] == lowest)


@dataclass(frozen=True)
class Sources:
    """What a quorum of given members may start from (``Agreement.sources``)."""

    acceptable: Callable[[int, str], bool]  # the states that may be its source
    learned: State | None  # what a server without records takes as agreed (``adopt`` records it)
    held: bool  # a member holds an acceptable state: without one no quorum forms
    current: bool  # a member holds the last agreed state (or none was agreed yet)


class Agreement:
    """The (round, hash) states the run agreed on, and which quorum made the states members
    reported."""

    def __init__(self) -> None:
        self._how: OrderedDict[State, str] = OrderedDict()
        self.latest: State | None = None  # the highest round agreed
        self._made_by: OrderedDict[State, str] = OrderedDict()
        self._unheld_logged = False

    def add(self, state: State, how: str) -> bool:
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

    # --- requests -----------------------------------------------------------------------------

    def refuse_unagreed(self, ask: QuorumAsk) -> None:
        """409 ``unagreed_state`` for a claim the run never agreed on (the module's contract)."""
        claim = (ask.round, ask.hash)
        known = claim in self._how or claim in self._made_by
        if ask.holds and ask.round > 0 and len(self._how) and not known:
            log.warning(
                "worker %s presented a state the run never agreed on (round %d, hash %s; the "
                "last agreed: %s): refused",
                ask.worker_id,
                ask.round,
                ask.hash,
                self.latest,
            )
            raise unagreed_state(claim, self.latest)

    def refuse_unheld(self, worker_id: str, state: State | None) -> None:
        """A swarm replica asks to enter the route table holding ``state`` (None: none). Where
        the run agreed on states, it must hold one: 409 ``state_required`` for none, 409
        ``unagreed_state`` for a state neither agreed nor reported made by a member of a
        quorum (a joiner's first quorum may still be open when it says ready: its own report
        is such a state). Unlike a quorum request, a round-0 state has no pass: a replica
        serves what it holds, and a quorum would not correct it before drivers use it. With no
        agreed state (the stage does not sync, or its first quorum has not formed) anything
        goes."""
        if not len(self._how):
            return
        if state is None:
            log.warning("peer %s said ready holding no state of its syncing stage", worker_id)
            raise state_required(worker_id, self.latest)
        if state not in self._how and state not in self._made_by:
            log.warning(
                "peer %s said ready holding a state its stage never agreed on (round %d, hash "
                "%s; the last agreed: %s): refused",
                worker_id,
                *state,
                self.latest,
            )
            raise unagreed_state(state, self.latest, READY_ADVICE)

    # --- forming ------------------------------------------------------------------------------

    def sources(self, asks: Sequence[QuorumAsk]) -> Sources:
        """The states a quorum of the members that asked ``asks`` may start from. Without
        records (a fresh run, or a restarted server) the members' majority says what was agreed
        (``learn``); then only agreed states can be a source."""
        learned = learn(asks) if not len(self._how) else None
        acceptable: Callable[[int, str], bool] = (
            (lambda r, h: (r, h) == learned) if learned else (lambda r, h: (r, h) in self._how)
        )
        held = any(a.holds and acceptable(a.round, a.hash) for a in asks)
        latest = self.latest
        current = latest is None or any((a.round, a.hash) == latest for a in asks if a.holds)
        return Sources(acceptable, learned, held, current)

    def unheld(self) -> None:
        """Every live worker asks and none holds an agreed state: said once until a quorum
        forms."""
        if not self._unheld_logged:
            self._unheld_logged = True
            log.error(
                "no worker asking holds a state the run agreed on (the last: %s): no quorum "
                "forms until one does",
                self.latest,
            )

    def lost(self) -> None:
        """Every live worker asks and none holds the last agreed state: the quorum goes on from
        the best agreed state held (logged)."""
        log.warning(
            "no live worker holds the run's state of round %d any more; going on from the "
            "best one held",
            self.latest[0] if self.latest else 0,
        )

    def adopt(self, sources: Sources, asks: Sequence[QuorumAsk], members: Sequence[str]) -> None:
        """A quorum of ``members`` (who asked ``asks``) forms from ``sources``: a learned state
        becomes agreed (logged)."""
        self._unheld_logged = False
        learned = sources.learned
        if learned is None:
            return
        held = sum((a.round, a.hash) == learned for a in asks)
        self.add(learned, "learned from the first quorum's members")
        (log.warning if learned[0] > 0 else log.info)(
            "no agreed state recorded (a fresh run, or the server restarted): the run's "
            "state is taken as round %d, hash %s, held by %d of %d members %s",
            learned[0],
            learned[1],
            held,
            len(asks),
            ", ".join(members),
        )

    # --- outcomes -----------------------------------------------------------------------------

    def note_made(self, outcome: QuorumOutcome, start_round: int) -> None:
        """A member applied its quorum's step: the state it reports was made by that quorum."""
        if outcome.ok and outcome.round == start_round + 1 and outcome.hash:
            self._made_by[(outcome.round, outcome.hash)] = outcome.quorum_id
            while len(self._made_by) > FINISHED_KEPT:
                self._made_by.popitem(last=False)

    def made_by(self, state: State) -> str:
        """The quorum whose step made ``state``; "" when not known."""
        return self._made_by.get(state, "")

    def reported_late(self, outcome: QuorumOutcome, ended: Ended) -> None:
        """A member reports to a quorum that already ended: it applied the step all the same
        (its state was made by that quorum), and a discarded quorum's states reported after its
        commit point may now be a strict majority's."""
        self.note_made(outcome, ended.start_round)
        if ended.status == "discarded" and outcome.ok and outcome.round is not None:
            ended.made.setdefault(outcome.worker_id, (outcome.round, outcome.hash))
            self.made_by_majority(outcome.quorum_id, ended)

    def made_by_majority(self, qid: str, ended: Ended) -> None:
        """The two generals: a state a strict majority of a discarded quorum's members reported
        after its commit point is one the run agreed on (the others receive it)."""
        made = list(ended.made.values())
        for state in set(made):
            if 2 * made.count(state) > len(ended.members) and self.add(
                state, f"made by a majority of discarded quorum {qid}"
            ):
                log.warning(
                    "quorum %s was discarded, but a majority of its members (%d of %d) applied "
                    "its step: round %d, hash %s is agreed",
                    qid,
                    made.count(state),
                    len(ended.members),
                    *state,
                )
