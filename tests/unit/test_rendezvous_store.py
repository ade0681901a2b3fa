"""The rendezvous' keys (server/allreduce/rendezvous.py) as pure state: who may touch a quorum's
keys, torch's store semantics (compare_set, add), waits woken by a change or ended by a forget,
and the bounds on what it holds."""

from __future__ import annotations

import asyncio

import pytest

from diloco.server.allreduce import rendezvous
from diloco.server.allreduce.rendezvous import RendezvousStore
from diloco.server.errors import ApiError
from tests.helpers.aio import let_loop_run
from tests.helpers.clock import FakeClock

QUORUMS = {"q1": ("a", "b"), "q2": ("a", "c")}


def store(clock: FakeClock | None = None) -> RendezvousStore:
    return RendezvousStore(QUORUMS.get, max_wait=5.0, clock=clock or FakeClock())


def refused(call: object, *args: object) -> tuple[int, str]:
    with pytest.raises(ApiError) as err:
        call(*args)  # type: ignore[operator]
    return err.value.status, err.value.code


def test_only_a_member_touches_its_quorums_keys_and_quorums_stay_apart() -> None:
    s = store()
    s.set("a", "q1", "0/0", b"one")
    s.set("a", "q2", "0/0", b"two")
    assert s.count("b", "q1") == 1 and s.count("c", "q2") == 1
    assert refused(s.set, "c", "q1", "0/0", b"x") == (403, "not_a_member")
    assert refused(s.delete, "b", "q2", "0/0") == (403, "not_a_member")
    assert refused(s.count, "a", "q9") == (404, "unknown_quorum")
    assert asyncio.run(s.get("b", "q1", "0/0", 0)) == b"one"
    assert s.held() == {"q1": 1, "q2": 1}


def test_compare_set_and_add_answer_as_torch_stores_do() -> None:
    s = store()
    assert s.compare_set("a", "q1", "k", b"", b"first") == b"first"  # absent, expected empty
    assert s.compare_set("a", "q1", "k", b"", b"second") == b"first"  # held value wins
    assert s.compare_set("a", "q1", "k", b"first", b"third") == b"third"
    assert s.compare_set("a", "q1", "gone", b"x", b"y") == b"x"  # absent, left so
    assert s.count("a", "q1") == 1
    assert s.add("a", "q1", "n", 2) == 2 and s.add("b", "q1", "n", -5) == -3
    assert refused(s.add, "a", "q1", "k", 1) == (409, "not_a_counter")
    assert s.delete("a", "q1", "n") and not s.delete("a", "q1", "n")


def test_a_wait_is_woken_by_the_set_it_waits_for() -> None:
    async def run() -> tuple[bool, bytes | None]:
        s = store()
        waiting = asyncio.ensure_future(s.wait("a", "q1", ["0/0", "0/1"], 5.0))
        getting = asyncio.ensure_future(s.get("b", "q1", "0/1", 5.0))
        s.set("a", "q1", "0/0", b"x")
        await let_loop_run()
        assert not waiting.done() and not getting.done()  # one of two keys: still waiting
        s.set("b", "q1", "0/1", b"y")
        return await waiting, await getting

    assert asyncio.run(run()) == (True, b"y")


def test_a_wait_past_its_deadline_answers_not_ready_and_is_cut_to_max_wait() -> None:
    async def run() -> bool:
        clock = FakeClock()
        s = store(clock)
        assert await s.wait("a", "q1", ["k"], 0.0) is False  # 0: a check
        waiting = asyncio.ensure_future(s.wait("a", "q1", ["k"], 100.0))
        await let_loop_run()  # it starts waiting now: its deadline is now + 5 s
        clock.now += 4.9
        s.set("b", "q1", "other", b"")  # a change wakes it: before its deadline, it waits on
        await let_loop_run()
        assert not waiting.done()
        clock.now += 0.1  # max_wait (5 s) has passed, not the 100 s asked
        s.set("b", "q1", "other", b"")
        return await waiting

    assert asyncio.run(run()) is False


def test_forgetting_a_quorum_ends_its_waits_with_410_and_drops_its_keys() -> None:
    async def run() -> tuple[int, str]:
        s = store()
        s.set("a", "q1", "k", b"v")
        waiting = asyncio.ensure_future(s.get("b", "q1", "absent", 5.0))
        await let_loop_run()
        assert s.forget("q1") == 1 and s.forget("q1") == 0
        with pytest.raises(ApiError) as err:
            await waiting
        return err.value.status, err.value.code

    assert asyncio.run(run()) == (410, "quorum_ended")


def test_keys_per_quorum_are_bounded_by_its_size_and_a_refusal_stores_nothing() -> None:
    s = store()
    limit = rendezvous.KEYS_BASE + rendezvous.KEYS_PER_MEMBER * 2
    for i in range(limit):
        s.set("a", "q1", f"k{i}", b"")
    assert refused(s.set, "a", "q1", "more", b"") == (413, "store_full")
    assert refused(s.compare_set, "a", "q1", "more", b"", b"x") == (413, "store_full")
    assert s.count("a", "q1") == limit
    s.set("a", "q1", "k0", b"again")  # a key it holds may change


def test_the_oldest_quorums_keys_go_past_the_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rendezvous, "QUORUMS_KEPT", 1)
    s = store()
    s.set("a", "q1", "k", b"")
    s.set("a", "q2", "k", b"")
    assert s.held() == {"q2": 1}
    assert refused(s.count, "a", "q1") == (410, "quorum_ended")


def test_a_closed_store_refuses_and_holds_nothing() -> None:
    s = store()
    s.set("a", "q1", "k", b"v")
    s.close()
    assert s.held() == {}
    assert refused(s.count, "a", "q1") == (503, "shutting_down")
