"""Stage sync's server side (``server/swarm/stage_quorums.py``) on a fake clock: one quorum
book per stage, each waiting only for its own stage's replicas; quorums of one stage whose
rendezvous keys the other stages' peers cannot touch; a peer moved to another stage leaving the
old stage's quorum; the comm dtype of a quorum as the all-reduce mode chooses it."""

from __future__ import annotations

import asyncio

import pytest

from diloco.server.config import ServerConfig
from diloco.server.errors import ApiError
from diloco.server.swarm.stage_quorums import StageQuorums
from diloco.wire.messages import QuorumAsk
from tests.helpers.clock import FakeClock

CONFIG = ServerConfig(
    swarm=True, stages=2, min_replicas=2, join_timeout=0.0, poll_timeout=5.0, heartbeat_timeout=0.0
)


def make(assigned: dict[str, int]) -> StageQuorums:
    quorums = StageQuorums(CONFIG, "inst", assigned, FakeClock(), lambda w: None, lambda w: None)
    for peer, stage in assigned.items():
        quorums.registered(peer, None, stage)
        quorums.comm[peer] = "bf16" if peer in ("a", "b") else "fp32"
    return quorums


def test_a_stages_quorum_forms_with_its_own_replicas_only() -> None:
    """Stage 0's two replicas ask and get their quorum while stage 1's are silent; its id names
    the stage's book; only its members may touch its keys; stage 1 has no quorum yet."""

    async def scenario() -> None:
        assigned = {"a": 0, "b": 0, "c": 1, "d": 1}
        quorums = make(assigned)
        quorums.open()
        asks = [quorums.quorum(QuorumAsk(w, 0, f"h-{w}", has_state=True)) for w in ("a", "b")]
        a, b = await asyncio.wait_for(asyncio.gather(*asks), 5)
        assert a is not None and b is not None
        assert a.members == b.members == ("a", "b") and a.quorum_id.startswith("inst-s0-")
        assert a.comm == "bf16"  # both members send bf16
        store = quorums.rendezvous
        assert store is not None
        store.set("a", a.quorum_id, "k", b"v")
        with pytest.raises(ApiError) as refused:
            store.set("c", a.quorum_id, "k", b"v")  # stage 1's peer: not a member
        assert refused.value.status == 403
        assert quorums.books[1].open is None and quorums.books[1].pending() == ()
        assert quorums.round_of("c") == 0
        quorums.close()

    asyncio.run(scenario())


def test_a_peer_moved_to_another_stage_leaves_the_old_stages_quorum() -> None:
    async def scenario() -> None:
        assigned = {"a": 0, "b": 0, "c": 1}
        quorums = make(assigned)
        quorums.open()
        asks = [quorums.quorum(QuorumAsk(w, 0, "h", has_state=True)) for w in ("a", "b")]
        await asyncio.wait_for(asyncio.gather(*asks), 5)
        assert quorums.books[0].open is not None
        assigned["a"] = 1  # the stage book's re-assignment, then the quorums are told
        quorums.registered("a", 0, 1)
        assert quorums.books[0].open is None and quorums.books[0].rounds_discarded == 1
        quorums.close()

    asyncio.run(scenario())


def test_a_peer_without_a_stage_gets_410_and_nothing_changes() -> None:
    quorums = make({"a": 0})
    with pytest.raises(ApiError) as refused:
        quorums.book_of("stranger")
    assert refused.value.status == 410
    assert all(book.pending() == () for book in quorums.books)
