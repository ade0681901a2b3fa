"""The rendezvous' keys (server/allreduce/rendezvous.py) as pure state: who may touch a quorum's
keys, torch's store semantics (compare_set, add), waits woken by a change or ended by a forget,
the bounds on what it holds, and a quorum's rank positions as key spaces of their own."""

from __future__ import annotations

import asyncio

import pytest

from diloco.server.allreduce import rendezvous
from diloco.server.allreduce.rendezvous import RendezvousStore
from diloco.server.errors import ApiError
from diloco.wire.messages.rendezvous import POSITIONS_LIMIT
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


def test_a_quorums_bytes_on_all_positions_together_are_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Keys and values count on every position of the quorum; a refusal changes nothing; a
    value replaced or deleted gives its bytes back."""
    monkeypatch.setattr(rendezvous, "QUORUM_BYTES", 100)
    s = store()
    s.set("a", "q1", "k", b"x" * 40, position=0)  # 41 bytes
    s.set("a", "q1", "k", b"x" * 40, position=7)  # 82
    assert refused(lambda: s.set("a", "q1", "j", b"x" * 18, position=3)) == (413, "store_full")
    assert refused(lambda: s.add("a", "q1", "n", 10**17, position=2)) == (413, "store_full")
    assert s.held() == {"q1": 2}
    s.set("a", "q1", "j", b"x" * 17, position=3)  # 100: exactly the bound
    s.set("a", "q1", "k", b"", position=0)  # 60
    s.set("c", "q2", "big", b"x" * 96)  # another quorum's bytes are its own
    assert s.delete("a", "q1", "j", position=3)  # 42
    s.set("a", "q1", "m", b"x" * 57, position=1)  # 100 again
    assert refused(lambda: s.set("a", "q1", "k", b"x", position=0)) == (413, "store_full")
    assert asyncio.run(s.get("a", "q1", "k", 0)) == b""


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


# --- rank positions (sharded groups averaging shard with shard) ---------------------------------


def test_positions_are_key_spaces_of_their_own_each_with_its_own_keys_limit() -> None:
    s = store()
    s.set("a", "q1", "0/0", b"whole", position=0)
    s.set("a", "q1", "0/0", b"rank-1", position=1)
    assert asyncio.run(s.get("b", "q1", "0/0", 0)) == b"whole"
    assert asyncio.run(s.get("b", "q1", "0/0", 0, position=1)) == b"rank-1"
    assert s.add("a", "q1", "n", 2, position=1) == 2 and s.add("a", "q1", "n", 5) == 5
    assert s.compare_set("b", "q1", "0/0", b"rank-1", b"x", position=1) == b"x"
    assert asyncio.run(s.get("a", "q1", "0/0", 0)) == b"whole"  # position 0 untouched
    assert s.delete("a", "q1", "n", position=1) and s.count("a", "q1") == 2
    assert s.count("a", "q1", position=1) == 1 and s.count("a", "q1", position=7) == 0
    assert s.held() == {"q1": 3}  # summed over the quorum's positions
    limit = rendezvous.KEYS_BASE + rendezvous.KEYS_PER_MEMBER * 2
    for i in range(limit - 1):
        s.set("a", "q1", f"k{i}", b"", position=1)
    assert refused(lambda: s.set("a", "q1", "more", b"", position=1)) == (413, "store_full")
    s.set("a", "q1", "more", b"", position=2)  # a full position leaves the others their room
    assert s.count("a", "q1", position=1) == limit and s.count("a", "q1", position=2) == 1


def test_a_wait_at_one_position_is_not_woken_by_a_set_at_another() -> None:
    async def run() -> bytes | None:
        s = store()
        getting = asyncio.ensure_future(s.get("b", "q1", "0/0", 5.0, position=1))
        waiting = asyncio.ensure_future(s.wait("b", "q1", ["0/0"], 5.0, position=1))
        await let_loop_run()
        s.set("a", "q1", "0/0", b"position 0's")
        await let_loop_run()
        assert not getting.done() and not waiting.done()
        s.set("a", "q1", "0/0", b"position 1's", position=1)
        assert await waiting is True
        return await getting

    assert asyncio.run(run()) == b"position 1's"


def test_a_non_member_is_refused_at_every_position_and_makes_nothing() -> None:
    s = store()
    s.set("a", "q1", "k", b"v", position=1)
    for position in (0, 1, 2, POSITIONS_LIMIT - 1):
        assert refused(lambda p=position: s.set("c", "q1", "k", b"x", position=p)) == (
            403,
            "not_a_member",
        )
        assert refused(lambda p=position: s.count("c", "q1", position=p)) == (403, "not_a_member")
    assert refused(lambda: s.count("c", "q9", position=1)) == (404, "unknown_quorum")
    assert s.held() == {"q1": 1}
    assert asyncio.run(s.get("a", "q1", "k", 0, position=1)) == b"v"


def test_a_position_outside_the_range_is_refused_and_changes_nothing() -> None:
    s = store()
    s.set("a", "q1", "k", b"v")
    for position in (-1, POSITIONS_LIMIT):
        assert refused(lambda p=position: s.set("a", "q1", "k", b"x", position=p)) == (
            400,
            "bad_field",
        )
        assert refused(lambda p=position: s.set("a", "q2", "k", b"x", position=p)) == (
            400,
            "bad_field",
        )
    assert s.held() == {"q1": 1}  # q2 not made, q1's key as it was
    assert asyncio.run(s.get("a", "q1", "k", 0)) == b"v"


def test_forget_drops_every_position_and_ends_waits_at_any_of_them() -> None:
    async def run() -> tuple[int, str]:
        s = store()
        for position in (0, 1, 5):
            s.set("a", "q1", "k", b"v", position=position)
        waiting = asyncio.ensure_future(s.get("b", "q1", "absent", 5.0, position=5))
        await let_loop_run()
        assert s.forget("q1") == 3 and s.held() == {}
        for position in (0, 1, 5, 9):
            assert refused(lambda p=position: s.count("a", "q1", position=p)) == (
                410,
                "quorum_ended",
            )
        with pytest.raises(ApiError) as err:
            await waiting
        return err.value.status, err.value.code

    assert asyncio.run(run()) == (410, "quorum_ended")


def test_the_bound_counts_quorums_so_many_positions_never_evict_their_own_quorum(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(rendezvous, "QUORUMS_KEPT", 1)
    s = store()
    for position in range(10):  # a group of 10 ranks: ten positions of one quorum
        s.set("a", "q1", "k", bytes([position]), position=position)
    assert s.held() == {"q1": 10}
    assert asyncio.run(s.get("b", "q1", "k", 0, position=0)) == b"\0"
    s.set("a", "q2", "k", b"")  # the next quorum: the oldest goes, every position of it
    assert s.held() == {"q2": 1}
    for position in (0, 9):
        assert refused(lambda p=position: s.count("a", "q1", position=p)) == (410, "quorum_ended")
