"""The sync barrier with a quorum rule (server/rounds/barrier.py, server/rounds/quorum.py) on a
fake clock: when a round may close, how late uploads are let in, and the auto grace window
derived from the arrivals of recent rounds, against hand-computed values. Without a rule the
barrier is today's (tests/unit/test_barrier.py, unchanged)."""

from __future__ import annotations

import pytest

from diloco.server.rounds.aggregator import Check, Verdict
from diloco.server.rounds.barrier import SyncBarrier
from diloco.server.rounds.quorum import QuorumRule
from tests.helpers.clock import FakeClock


def barrier(
    clock: FakeClock, quorum: int | float = 2, grace: float | None = 5.0, max_lateness: int = 1
) -> SyncBarrier:
    rule = QuorumRule(
        quorum, grace, floor=0.5, ceiling=30.0, max_lateness=max_lateness, clock=clock
    )
    b = SyncBarrier(3, 1, quorum=rule)
    b.on_register({"a", "b", "c"})
    return b


def submit(b: SyncBarrier, worker: str, base: int) -> None:
    sid = f"{worker}-{base}"
    assert b.check(worker, base, sid).verdict is Verdict.ACCEPT
    b.begin_upload(worker, sid)
    b.record(worker, sid, base)


def close(b: SyncBarrier) -> None:
    b.begin_close()
    b.advance({"a", "b", "c"})


def test_a_round_closes_once_its_quorum_is_in_and_the_grace_has_passed() -> None:
    clock = FakeClock()
    b = barrier(clock)
    submit(b, "a", 0)
    assert not b.ready() and b.deadline() is None  # one of two
    clock.now += 1.0
    submit(b, "b", 0)  # the quorum, at 1001
    b.begin_upload("c", "c-0")  # the third still arriving does not hold the round
    assert b.deadline() == 1006.0 and not b.ready()
    clock.now = 1005.9
    assert not b.ready()
    clock.now = 1006.0
    assert b.ready()
    assert b.begin_close() == 0
    assert b.deadline() is None  # a closing round has no deadline


def test_every_expected_worker_in_closes_at_once_and_min_workers_still_holds() -> None:
    clock = FakeClock()
    b = barrier(clock)
    for w in "abc":
        submit(b, w, 0)
    assert b.ready()  # no grace to sit out: nobody else is coming
    rule = QuorumRule(1, 0.0, floor=0.5, ceiling=30.0, max_lateness=1, clock=clock)
    strict = SyncBarrier(3, 2, quorum=rule)
    strict.on_register({"a", "b", "c"})
    assert strict.quorum is not None and strict.quorum.k == 2  # never below min_workers
    submit(strict, "a", 0)
    assert not strict.ready()


def test_a_fractional_quorum_is_of_the_round_s_expected_workers() -> None:
    clock = FakeClock()
    b = barrier(clock, quorum=0.5, grace=0.0)
    assert b.quorum is not None and b.quorum.k == 2  # 0.5 x 3 rounded up
    submit(b, "a", 0)
    assert not b.ready()
    submit(b, "b", 0)
    assert b.ready()
    b.begin_close()
    b.advance({"a", "b", "c", "d"})
    assert b.quorum.k == 2  # 0.5 x 4


def test_late_uploads_are_admitted_within_max_lateness_and_refused_beyond() -> None:
    clock = FakeClock()
    b = barrier(clock, grace=0.0)
    submit(b, "a", 0)
    b.begin_upload("c", "c-0")  # begun in round 0, lands after it closed
    submit(b, "b", 0)
    assert b.ready()
    b.begin_close()
    with pytest.raises(AssertionError):
        b.record("c", "c-0", 0)  # nothing is counted into a round mid-close
    b.advance({"a", "b", "c"})
    assert b.check("c", 0, "c-0") == Check(Verdict.IN_PROGRESS, 1)  # its own upload is in flight
    b.record("c", "c-0", 0)  # counted in round 1
    assert b.history["c-0"] == 1 and b.submitted == {"c": "c-0"}
    assert b.check("c", 0, "c-0") == Check(Verdict.DUPLICATE, 1, 1)  # a retry counts once
    assert b.check("b", 0, "b-0-again") == Check(Verdict.ACCEPT, 1, staleness=1)
    assert b.check("c", 1, "c-1") == Check(Verdict.ALREADY_SUBMITTED, 1)
    submit(b, "a", 1)
    close(b)
    assert b.round == 2
    assert b.check("b", 0, "b-0-again") == Check(Verdict.STALE, 2)  # 2 rounds late > 1
    assert b.check("b", 1, "b-1") == Check(Verdict.ACCEPT, 2, staleness=1)


def test_an_upload_begun_while_its_round_closes_is_admitted_to_be_merged_late() -> None:
    clock = FakeClock()
    b = barrier(clock, grace=0.0)
    submit(b, "a", 0)
    submit(b, "b", 0)
    b.begin_close()
    assert b.check("c", 0, "c-0") == Check(Verdict.ACCEPT, 0, staleness=0)  # not round_closing
    plain = SyncBarrier(3, 1)
    plain.on_register({"a", "b", "c"})
    submit(plain, "a", 0)
    plain.begin_upload("b", "b-0")
    plain.record("b", "b-0")
    assert not plain.ready()  # today's barrier: c is expected


def test_without_max_lateness_late_uploads_are_refused_as_today() -> None:
    clock = FakeClock()
    b = barrier(clock, grace=0.0, max_lateness=0)
    submit(b, "a", 0)
    submit(b, "b", 0)
    close(b)
    assert b.check("c", 0, "c-0") == Check(Verdict.STALE, 1)


def test_the_auto_window_follows_recent_arrivals_and_ignores_one_frozen_worker() -> None:
    clock = FakeClock()
    b = barrier(clock, grace=None)
    rule = b.quorum
    assert rule is not None
    submit(b, "a", 0)  # 1000
    clock.now = 1002.0
    submit(b, "b", 0)  # the quorum: offsets [-2, 0], median -1, MAD 1: -1 + 3 = 2
    assert rule.window == 2.0 and b.deadline() == 1004.0
    clock.now = 1003.0
    submit(b, "c", 0)  # offset 1, and everyone is in
    assert b.ready()
    close(b)
    clock.now = 1010.0
    submit(b, "a", 1)
    clock.now = 1011.0
    submit(b, "b", 1)  # offsets [-2, 0, 1, -1, 0]: median 0, MAD 1 -> 3
    assert rule.window == 3.0 and b.deadline() == 1014.0
    clock.now = 1014.0
    assert b.ready()  # c is frozen
    close(b)
    clock.now = 1020.0
    b.begin_upload("c", "c-1")
    b.record("c", "c-1", 1)  # late: 9 s after round 1's quorum, counted in round 2
    clock.now = 1021.0
    submit(b, "a", 2)  # round 2's quorum (c and a): a's offset 0 (c's counted once, as late)
    # [-2, 0, 1, -1, 0, 9, 0]: median 0, deviations' median 1 -> 3; the 9 is one outlier
    assert rule.offsets() == [-2.0, 0.0, 1.0, -1.0, 0.0, 9.0, 0.0]
    assert rule.window == 3.0


def test_the_first_auto_window_is_the_spread_of_the_round_s_own_arrivals() -> None:
    clock = FakeClock()
    b = barrier(clock, grace=None)
    submit(b, "a", 0)
    clock.now += 4.0
    submit(b, "b", 0)  # offsets [-4, 0]: median -2, MAD 2 -> -2 + 6 = 4
    assert b.quorum is not None and b.quorum.window == 4.0
    clock.now += 4.0
    close(b)
    submit(b, "a", 1)
    submit(b, "b", 1)  # [-4, 0, 0, 0]: median 0, MAD 0 -> the floor
    assert b.quorum.window == 0.5
    fresh = SyncBarrier(
        3, 1, quorum=QuorumRule(3, None, floor=0.5, ceiling=30.0, max_lateness=1, clock=clock)
    )
    fresh.on_register({"a", "b", "c"})
    assert fresh.deadline() is None


def test_the_auto_window_is_capped_at_its_ceiling() -> None:
    clock = FakeClock()
    b = barrier(clock, grace=None)
    submit(b, "a", 0)
    clock.now += 100.0
    submit(b, "b", 0)  # offsets [-100, 0]: median -50, MAD 50 -> 100, capped at 30
    assert b.quorum is not None and b.quorum.window == 30.0 and b.deadline() == 1130.0
