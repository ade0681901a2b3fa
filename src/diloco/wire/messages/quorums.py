"""All-reduce mode's rounds: ``POST /quorum`` (``QuorumAsk``, answered by an ``Assignment``, or
``Pending`` when no quorum formed within the long poll) and ``POST /quorum/outcome``
(``QuorumOutcome``, answered by ``OutcomeRecorded``). When a quorum forms and where it starts
is ``server/quorum.py``'s; what a worker does with its assignment, ``worker/allreduce/``'s.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Self

from diloco.wire.messages.codec import MessageError, Reply, Request, Rule, at_least, spec, text
from diloco.wire.messages.registration import Rendezvous
from diloco.wire.messages.uploads import MAX_WEIGHT, Pending

HASH_LIMIT = 256
ERROR_LIMIT = 500
STAGES = ("", "join", "resync", "average", "check", "commit")
"""Where a failed round broke off on a member (``QuorumOutcome.stage``; "" when not said)."""
EXCLUDED_LIMIT = 1024
"""A failure's ``error`` is cut to this many characters (not refused: it is a log line)."""

QUORUM_ID = re.compile(r"[A-Za-z0-9_.-]{1,64}")
"""What a quorum id may be: restricted so that no quorum's store prefix is another's (``a``
against ``a/b``)."""


def quorum_prefix(quorum_id: str) -> str:
    """The rendezvous store prefix of one quorum, ``quorum/<id>`` (``PrefixStore`` adds the
    ``/``): the server hosts the store and forgets a quorum's keys under it
    (``server/allreduce/rendezvous.py``), the members build their process group on it
    (``worker/allreduce/connect.py``). A ``ValueError`` for an id outside ``QUORUM_ID``."""
    if not QUORUM_ID.fullmatch(quorum_id):
        raise ValueError(f"quorum id must match {QUORUM_ID.pattern}, got {quorum_id!r}")
    return f"quorum/{quorum_id}"


@dataclass(frozen=True)
class QuorumAsk(Request):
    """``POST /quorum``: ask for this round's quorum, presenting the state the worker holds."""

    worker_id: str = spec(rule=text())
    """The registered worker."""
    round: int = spec(rule=at_least(0))
    """The round of the state it holds."""
    hash: str = spec(default="", rule=text(HASH_LIMIT, empty=True))
    """That state's hash; empty: none it can vouch for (it must receive the run's)."""
    has_state: bool | None = spec(default=None, omit=True)
    """It holds state; absent: whether a hash is given (read as that)."""
    weight: float | None = spec(
        default=None,
        omit=True,
        rule=Rule(f"a number in [0, {MAX_WEIGHT:g}]", lambda v: 0 <= v <= MAX_WEIGHT),
    )
    """The weight it would contribute (0 joining, 1 under equal weighting, its samples under
    ``samples``): bounded as an upload's weight in server mode; absent: not said."""

    @property
    def holds(self) -> bool:
        """The worker holds a state it can vouch for."""
        return bool(self.has_state) and bool(self.hash)

    def checked(self) -> Self:
        return self if self.has_state is not None else replace(self, has_state=bool(self.hash))


@dataclass(frozen=True, kw_only=True)
class Assignment(Reply):
    """The 200 reply to ``QuorumAsk``: this worker's place in the quorum formed, the state the
    quorum starts from, who sends it to whom, and where the members meet."""

    quorum_id: str
    """The quorum's id (its process group's store prefix)."""
    rank: int
    """This worker's rank (ranks follow the worker ids' order)."""
    size: int
    """Members."""
    members: tuple[str, ...] = ()
    """The members' worker ids, by rank."""
    round: int
    """The round of the state the quorum starts from."""
    hash: str = ""
    """That state's hash."""
    source: int
    """The rank that broadcasts it (the lowest holding it)."""
    resync: tuple[int, ...] = ()
    """The ranks that must receive it before contributing."""
    rendezvous: Rendezvous
    """Where the members meet."""
    timeout: float
    """Seconds a collective may wait for a member."""
    save: bool = False
    """Rank 0 writes a checkpoint after the round (``--save-every``, ``/control/save_state``)."""
    made_by: str = ""
    """The quorum whose step made the starting state ("" when unknown): a member whose commit
    point failed in that quorum takes the state without counting its progress again."""
    comm: str = "fp32"
    """What the all-reduce carries: ``bf16`` when every member registered bf16, else
    ``fp32``."""

    @property
    def receiving(self) -> bool:
        """This worker must receive the quorum's state before contributing."""
        return self.rank in self.resync


def quorum_reply(data: object) -> Assignment | Pending:
    """The reply to ``QuorumAsk``: an assignment, or ``Pending`` (the long poll ended first)."""
    if isinstance(data, dict) and data.get("status") == "pending":
        return Pending.from_json(data)
    return Assignment.from_json(data)


@dataclass(frozen=True)
class QuorumOutcome(Request):
    """``POST /quorum/outcome``: how a quorum's round ended on this member."""

    worker_id: str = spec(rule=text())
    """The registered worker."""
    quorum_id: str = spec(rule=text())
    """The quorum (``Assignment.quorum_id``)."""
    ok: bool = spec()
    """The round completed here."""
    round: int | None = spec(default=None, rule=at_least(0), omit=True)
    """When ok: the round of the state after it (the quorum's + 1, or the quorum's when no
    step was taken)."""
    hash: str = spec(default="", rule=text(HASH_LIMIT, empty=True), omit=True)
    """When ok: that state's hash."""
    error: str = spec(default="", omit=True)
    """When not ok: why (cut to ``ERROR_LIMIT`` characters)."""
    stage: str = spec(default="", omit=True, rule=Rule(f"one of {STAGES}", lambda v: v in STAGES))
    """When not ok: where the round broke off (``STAGES``)."""
    excluded: tuple[str, ...] = spec(
        default=(),
        omit=True,
        rule=Rule(f"at most {EXCLUDED_LIMIT} worker ids", lambda v: len(v) <= EXCLUDED_LIMIT),
    )
    """The members (worker ids) whose contribution the quorum's checks left out of this round:
    a non-finite pseudo-gradient, a norm far outside the quorum's, a weight out of bounds."""

    def checked(self) -> Self:
        if self.ok and self.round is None:
            raise MessageError("round", "missing field 'round' (required when 'ok')")
        if self.ok and not self.hash:
            raise MessageError("hash", "'hash' must be a non-empty string when 'ok'")
        return (
            self
            if len(self.error) <= ERROR_LIMIT
            else replace(self, error=self.error[:ERROR_LIMIT])
        )


@dataclass(frozen=True, kw_only=True)
class OutcomeRecorded(Reply):
    """The reply to ``QuorumOutcome``; for a quorum that already ended, how it ended."""

    status: str
    """``recorded``, or ``discarded`` (the quorum ended without completing)."""
    quorum_id: str
    """The quorum."""
    round: int
    """The run's round now."""
    detail: str | None = spec(default=None, omit=True)
    """Why a quorum was discarded."""
