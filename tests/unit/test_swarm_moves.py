"""The coordinator moving a peer when a stage's last replica left (issue 29 item 6): the pure
policy (``assignment.choose_move``) on hand-computed cases, and the stage book recording a move
at once (``StageBook.rebalance``) on a fake clock."""

from __future__ import annotations

from diloco.server.swarm.assignment import choose_move
from diloco.server.swarm.stage_book import StageBook
from diloco.wire.messages.registration import SwarmBeat
from diloco.wire.messages.swarm import StageReady
from tests.helpers.clock import FakeClock

TABLE = (("0.weight", (8, 4)),)


def test_no_move_while_every_served_stage_has_a_replica_or_none_can_spare_one() -> None:
    assert choose_move(3, {"h": 0, "a": 1, "b": 1, "t": 2}, {}, {}) is None
    assert choose_move(3, {"h": 0, "a": 1, "b": 2}, {}, {}) is None  # stage 1 and 2 hold one
    assert choose_move(3, {"h": 0, "a": 1}, {}, {}) is None  # no stage has two
    only = {"h": 0, "a": 1, "b": 1}
    assert choose_move(3, only, {}, {}, movable={"h"}) is None  # a or b could, not movable
    assert choose_move(3, only, {}, {}, movable={"b"}) == ("b", 2)


def test_the_peer_comes_from_the_stage_with_the_most_replicas_the_slowest_then_the_id() -> None:
    assigned = {"h": 0, "a": 1, "b": 1, "c": 3, "d": 3, "e": 3}
    fast = {"c": 9.0, "d": 2.0, "e": 5.0}
    assert choose_move(4, assigned, {}, fast) == ("d", 2)
    assert choose_move(4, assigned, {}, {}) == ("c", 2)  # none reported: by id
    assert choose_move(4, assigned, {}, {"c": 1.0}) == ("d", 2)  # unreported counts lowest


def test_a_body_replica_is_taken_before_a_head_and_only_one_that_fits() -> None:
    assigned = {"h1": 0, "h2": 0, "a": 1, "b": 1}
    assert choose_move(3, assigned, {}, {}) == ("a", 2)
    assert choose_move(3, assigned, {"a": (1,), "b": (1,)}, {}) == ("h1", 2)
    assert choose_move(3, assigned, {"a": (1,), "b": (1,), "h1": (0,), "h2": (0, 1)}, {}) is None


def test_the_head_stage_is_never_a_target_and_the_lowest_empty_stage_comes_first() -> None:
    assert choose_move(3, {"a": 1, "b": 1, "c": 2}, {}, {}) is None  # no head: no drivers
    assert choose_move(4, {"h": 0, "a": 1, "b": 1, "c": 1}, {}, {}) == ("a", 2)


def test_the_book_moves_a_peer_when_a_stages_last_replica_leaves_and_tells_it_once() -> None:
    book = StageBook(3, 1, FakeClock())
    for peer, k in (("h", 0), ("a", 1), ("t", 2), ("b", 1)):
        assert book.assign(peer, (k,) if peer != "b" else (1, 2)) == k
        book.mark_ready(StageReady(peer, k, TABLE if k else (), f"http://127.0.0.1:{9000 + k}"))
    book.heard("b", SwarmBeat(throughput=3.0))
    version = book.version
    assert book.rebalance() == []
    book.ready.pop("b")  # a stage-sync worker that never served is not moved
    book.left("t")
    assert book.rebalance() == []
    book.assign("t", (2,))
    book.mark_ready(StageReady("b", 1, TABLE, "http://127.0.0.1:9001"))
    book.mark_ready(StageReady("t", 2, TABLE, "http://127.0.0.1:9002"))
    book.left("t")
    assert book.rebalance() == [("b", 1, 2)]  # "a" fits stage 1 only
    assert book.assigned["b"] == 2 and book.moves == {"b": 2}
    assert "b" not in book.ready  # out of the table until it says ready for stage 2
    assert [r.peer_id for r in book.routes().stages[1].replicas] == ["a"]
    assert book.routes().stages[2].replicas == () and book.version > version
    book.assign("b", (2,))  # it registered again for stage 2: nothing left to tell
    assert book.moves == {} and book.assigned["b"] == 2
