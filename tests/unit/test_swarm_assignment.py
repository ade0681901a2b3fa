"""Swarm mode's coordinator state without a server: the stage assignment policy
(``server/swarm/assignment.py``) on hand-computed cases, and the stage book's route table,
checks and versions (``server/swarm/stage_book.py``) on a fake clock."""

from __future__ import annotations

import asyncio

import pytest

from diloco.server.errors import ApiError
from diloco.server.swarm.assignment import choose_stage, stage_throughput
from diloco.server.swarm.stage_book import StageBook
from diloco.wire.messages.registration import BoundaryTraffic, SwarmBeat
from diloco.wire.messages.swarm import StageReady, SuspectReport
from tests.helpers.clock import FakeClock

TABLE = (("0.weight", (8, 4)), ("0.bias", (8,)))


# --- the policy -----------------------------------------------------------------------------------


def test_stages_fill_to_min_replicas_fewest_first_then_lowest_index() -> None:
    """Six peers, 3 stages, min 2: 0, 1, 2, 0, 1, 2 (a whole pipeline after three joins)."""
    replicas: dict[int, list[float | None]] = {}
    order = []
    for _ in range(6):
        stage = choose_stage(3, 2, replicas)
        order.append(stage)
        replicas.setdefault(stage, []).append(None)
    assert order == [0, 1, 2, 0, 1, 2]


def test_a_peer_goes_only_to_a_stage_that_fits_it() -> None:
    replicas: dict[int, list[float | None]] = {0: [None], 1: [None], 2: []}
    assert choose_stage(3, 2, replicas) == 2
    assert choose_stage(3, 2, replicas, fits={0, 1}) == 0
    assert choose_stage(3, 2, replicas, fits={1}) == 1
    with pytest.raises(ValueError, match="none of the stages the peer fits"):
        choose_stage(3, 2, replicas, fits={5, 7})


def test_beyond_min_replicas_the_bottleneck_by_reported_throughput_is_fed() -> None:
    # Stage totals: 0 -> 10 + 10 = 20; 1 -> 4 + 6 = 10 (the bottleneck); 2 -> 30 + 30 = 60.
    replicas: dict[int, list[float | None]] = {0: [10.0, 10.0], 1: [4.0, 6.0], 2: [30.0, 30.0]}
    assert choose_stage(3, 2, replicas) == 1
    # A replica that did not report counts as its stage's mean: stage 1 -> 4 + 4 = 8 still.
    replicas[1] = [4.0, None]
    assert stage_throughput(replicas[1]) == 8.0
    assert choose_stage(3, 2, replicas) == 1
    # Only stages that fit compete: stage 0 (20) is slower than stage 2 (60).
    assert choose_stage(3, 2, replicas, fits=[0, 2]) == 0


def test_while_a_fitting_stage_is_unmeasured_the_replica_count_decides() -> None:
    replicas: dict[int, list[float | None]] = {0: [1.0, 1.0, 1.0], 1: [None, None], 2: [9.0, 9.0]}
    assert choose_stage(3, 2, replicas) == 1  # fewest replicas (2), lowest index among 1 and 2
    assert choose_stage(3, 2, replicas, fits=[0, 2]) == 0  # both measured: 3 < 18


def test_a_peer_leaving_is_replaced_on_its_stage_first() -> None:
    book = StageBook(3, 1, FakeClock())
    for peer in ("a", "b", "c"):
        book.assign(peer, None)
    assert book.assigned == {"a": 0, "b": 1, "c": 2}
    book.left("b")
    assert book.assign("d", None) == 1
    # Re-registering keeps a peer's stage while it still fits it.
    assert book.assign("a", None) == 0 and book.assign("a", [0, 2]) == 0


# --- the book -------------------------------------------------------------------------------------


def ready(peer: str, stage: int, table: tuple = TABLE, port: int = 8700) -> StageReady:
    return StageReady(peer, stage, table, f"http://127.0.0.1:{port}")


def three_ready() -> StageBook:
    book = StageBook(2, 1, FakeClock())
    for peer in ("a", "b", "c"):
        book.assign(peer, None)  # a: 0, b: 1, c: 0
    for i, peer in enumerate(("a", "b", "c")):
        book.mark_ready(ready(peer, book.assigned[peer], port=8700 + i))
    return book


def peers(book: StageBook, stage: int) -> list[str]:
    return [r.peer_id for r in book.routes().stages[stage].replicas]


def test_the_first_ready_replica_fixes_the_stage_table_and_a_different_one_changes_nothing() -> (
    None
):
    book = three_ready()
    before = (book.routes(), dict(book.ready), dict(book.tables))
    book.assign("d", [0])
    other = (("0.weight", (8, 5)), ("0.bias", (8,)))
    with pytest.raises(ApiError) as refused:
        book.mark_ready(ready("d", 0, other))
    assert refused.value.status == 409 and refused.value.code == "params_mismatch"
    assert "0.weight has shape [8, 5], the run's is [8, 4]" in refused.value.detail
    assert (book.routes(), dict(book.ready), dict(book.tables)) == before
    with pytest.raises(ApiError) as wrong:
        book.mark_ready(ready("d", 1))
    assert wrong.value.code == "wrong_stage" and "assigned stage 0" in wrong.value.detail
    assert book.routes() == before[0]


def test_a_registration_again_keeps_the_stage_but_needs_ready_again() -> None:
    book = three_ready()
    v = book.version
    assert book.assign("c", None) == 0
    assert peers(book, 0) == ["a"] and book.version == v + 1
    book.mark_ready(ready("c", 0, port=8799))
    assert book.routes().stages[0].replicas[1].address == "http://127.0.0.1:8799"


def test_a_suspect_is_out_until_its_next_heartbeat_and_each_change_bumps_the_version() -> None:
    book = three_ready()
    assert peers(book, 0) == ["a", "c"] and peers(book, 1) == ["b"]
    v = book.version
    assert book.report(SuspectReport("b", "c", 0, "timeout")) == v + 1
    assert peers(book, 0) == ["a"]
    assert book.report(SuspectReport("b", "c", 0, "again")) == v + 1  # no change, no new version
    with pytest.raises(ApiError) as wrong:
        book.report(SuspectReport("a", "b", 0, "wrong stage"))
    assert wrong.value.code == "wrong_stage" and peers(book, 1) == ["b"]
    book.heard("c", None)
    assert peers(book, 0) == ["a", "c"] and book.version == v + 2
    # A throughput reported orders the replicas (fastest first) and is a change.
    book.heard("c", SwarmBeat(throughput=5.0))
    assert peers(book, 0) == ["c", "a"] and book.version == v + 3
    book.left("c")
    assert peers(book, 0) == ["a"] and "c" not in book.assigned and book.version == v + 4


def test_the_long_poll_answers_at_once_on_another_version_on_change_or_at_its_bound() -> None:
    book = three_ready()

    async def scenario() -> None:
        v = book.version
        assert (await book.wait(v - 1, 5.0)).version == v  # at once
        assert (await book.wait(v, 0.01)).version == v  # bounded
        waiter = asyncio.ensure_future(book.wait(v, 5.0))
        await asyncio.sleep(0)  # the waiter is parked on the wakeup (no timing involved)
        assert not waiter.done()
        book.left("b")
        table = await asyncio.wait_for(waiter, 5.0)
        assert table.version == v + 1 and table.stages[1].replicas == ()

    asyncio.run(scenario())


def test_the_status_sums_what_the_senders_report_per_boundary_and_direction() -> None:
    book = three_ready()
    fwd = BoundaryTraffic(0, "forward", 68 * 100, 100)  # int8 rows of 64 + a 4-byte scale
    book.heard("a", SwarmBeat(throughput=2.0, boundaries=(fwd,), reroutes=3, recoveries=2))
    book.heard("c", SwarmBeat(throughput=4.0, boundaries=(fwd,), reroutes=1, recoveries=1))
    book.heard("b", SwarmBeat(boundaries=(BoundaryTraffic(0, "backward", 400, 100),), recomputes=2))
    book.report(SuspectReport("a", "b", 1, "reset"))
    st = book.public()
    assert [(b.boundary, b.direction, b.bytes, b.bytes_per_token) for b in st.boundaries] == [
        (0, "backward", 400, 4.0),
        (0, "forward", 13600, 68.0),
    ]
    assert (st.reroutes, st.recoveries, st.recomputes, st.suspect_reports) == (4, 3, 2, 1)
    assert [(s.peer_id, s.stage, s.reporter, s.reason) for s in st.suspects] == [
        ("b", 1, "a", "reset")
    ]
    stage0, stage1 = st.stages
    assert stage0.assigned == ("a", "c") and stage0.throughput == 6.0
    assert stage0.num_params == 40 and stage1.ready == () and stage1.throughput is None
