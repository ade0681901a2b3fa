"""A swarm replica enters the route table only holding its stage's agreed state (issue 29, part
H): the quorum book's check of a ``POST /swarm/ready`` (``Agreement.refuse_unheld``, reached per
stage through ``StageQuorums.refuse_unheld``), and the ready message's state fields. Pure: a
fake clock, no sockets."""

from __future__ import annotations

import asyncio

import pytest

from diloco.server.allreduce.agreement import Agreement
from diloco.server.config import ServerConfig
from diloco.server.errors import ApiError
from diloco.server.swarm.stage_quorums import StageQuorums
from diloco.wire.messages import QuorumAsk, QuorumOutcome
from diloco.wire.messages.codec import MessageError
from diloco.wire.messages.swarm import StageReady
from tests.helpers.clock import FakeClock

CONFIG = ServerConfig(
    swarm=True, stages=2, min_replicas=2, join_timeout=0.0, poll_timeout=5.0, heartbeat_timeout=0.0
)
TABLE = (("1.weight", (4, 4)),)


def ready(peer: str, stage: int, state: tuple[int, str] | None) -> StageReady:
    r, h = state if state is not None else (None, None)
    return StageReady(peer, stage, TABLE, "http://127.0.0.1:9", round=r, state_hash=h)


def refusal(check: object, *args: object) -> ApiError:
    with pytest.raises(ApiError) as refused:
        check(*args)  # type: ignore[operator]
    return refused.value


def test_an_agreement_without_states_takes_any_ready() -> None:
    """No stage sync (or its first quorum not formed yet): no state, or any, is let in."""
    agreement = Agreement()
    agreement.refuse_unheld("a", None)
    agreement.refuse_unheld("a", (7, "anything"))


def test_once_states_are_agreed_a_ready_must_hold_one() -> None:
    """No state: 409 ``state_required``; a state never agreed (a forged hash, an agreed hash at
    another round, a round-0 state of its own, which a quorum request would be let in with):
    409 ``unagreed_state``; an agreed state, the latest or an older one: let in. The refusals
    change nothing: the agreement holds the same states and latest."""
    agreement = Agreement()
    agreement.add((0, "h0"), "learned")
    agreement.add((1, "h1"), "a quorum")
    none = refusal(agreement.refuse_unheld, "a", None)
    assert none.status == 409 and none.code == "state_required"
    assert none.reply.round == 1 and "h1" in none.detail
    for claim in [(1, "forged"), (2, "h1"), (0, "own-start")]:
        wrong = refusal(agreement.refuse_unheld, "a", claim)
        assert wrong.status == 409 and wrong.code == "unagreed_state", claim
        assert "route table" in wrong.detail  # the ready's advice, not the quorum request's
    assert len(agreement) == 2 and agreement.latest == (1, "h1")
    agreement.refuse_unheld("a", (1, "h1"))
    agreement.refuse_unheld("a", (0, "h0"))


def make(assigned: dict[str, int]) -> StageQuorums:
    quorums = StageQuorums(CONFIG, "inst", assigned, FakeClock(), lambda w: None, lambda w: None)
    for peer, stage in assigned.items():
        quorums.registered(peer, None, stage)
        quorums.comm[peer] = "fp32"
    return quorums


def test_each_stage_checks_readies_against_its_own_quorums() -> None:
    """Stage 0's replicas form a quorum from (0, h0) (learned: agreed), then one member reports
    the state its step made, (1, h1), while the quorum is still open (the other has not
    reported: a joiner says ready before its stage's quorum completes). On stage 0: no state
    refused (``state_required``), a state it never agreed refused (``unagreed_state``), (0, h0)
    and the reported (1, h1) let in. Stage 1 has no quorum yet (no agreed state: as a stage
    without stage sync): a ready with no state, or any, is let in."""

    async def scenario() -> None:
        quorums = make({"a": 0, "b": 0, "c": 1})
        quorums.open()
        asks = [quorums.quorum(QuorumAsk(w, 0, "h0", has_state=True)) for w in ("a", "b")]
        a, _ = await asyncio.wait_for(asyncio.gather(*asks), 5)
        assert a is not None
        quorums.outcome(QuorumOutcome("a", a.quorum_id, True, round=1, hash="h1"))
        assert quorums.books[0].open is not None  # b has not reported: still open
        assert refusal(quorums.refuse_unheld, ready("b", 0, None)).code == "state_required"
        for claim in [(1, "forged"), (0, "h1")]:
            assert refusal(quorums.refuse_unheld, ready("b", 0, claim)).code == "unagreed_state"
        quorums.refuse_unheld(ready("b", 0, (0, "h0")))
        quorums.refuse_unheld(ready("b", 0, (1, "h1")))
        quorums.refuse_unheld(ready("c", 1, None))
        quorums.refuse_unheld(ready("c", 1, (3, "whatever")))
        quorums.close()

    asyncio.run(scenario())


def test_a_ready_gives_its_round_and_hash_together_or_neither() -> None:
    """The state is omitted from the JSON when absent; one field without the other, a negative
    round or an empty hash is a ``MessageError`` naming the field."""
    plain = ready("a", 1, None).to_json()
    assert "round" not in plain and "state_hash" not in plain
    held = ready("a", 1, (3, "abc"))
    assert StageReady.from_json(held.to_json()).state == (3, "abc")
    for extra, field in [
        ({"round": 3}, "state_hash"),
        ({"state_hash": "abc"}, "round"),
        ({"round": -1, "state_hash": "abc"}, "round"),
        ({"round": 1, "state_hash": ""}, "state_hash"),
    ]:
        with pytest.raises(MessageError) as bad:
            StageReady.from_json({**plain, **extra})
        assert field in str(bad.value), extra
