"""The synchronous barrier's rules, driven directly: no server, no sockets, no tensors."""

from __future__ import annotations

import pytest

from diloco.server.rounds.barrier import Check, SyncBarrier, Verdict


def submit(barrier: SyncBarrier, worker: str, sid: str, base_round: int | None = None) -> None:
    """Check, upload and record one submission, insisting that it is accepted."""
    base = barrier.round if base_round is None else base_round
    check = barrier.check(worker, base, sid)
    assert check.verdict is Verdict.ACCEPT, check
    barrier.begin_upload(worker, sid)
    barrier.record(worker, sid)


def opened(num_workers: int, workers: set[str], min_workers: int = 1) -> SyncBarrier:
    barrier = SyncBarrier(num_workers, min_workers)
    barrier.on_register(set(workers))
    assert barrier.opened
    return barrier


def close_round(barrier: SyncBarrier, live: set[str]) -> int:
    assert barrier.ready()
    closed = barrier.begin_close()
    barrier.advance(live)
    return closed


# --- construction ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("num_workers", "min_workers"),
    [(0, 1), (-1, 1), (2, 0), (2, -1), (2, 3), (1, 2)],
)
def test_constructor_rejects_bad_counts(num_workers: int, min_workers: int) -> None:
    with pytest.raises(ValueError):
        SyncBarrier(num_workers, min_workers)


def test_constructor_accepts_edges_and_a_start_round() -> None:
    b = SyncBarrier(1)
    assert (b.num_workers, b.min_workers, b.round, b.opened) == (1, 1, 0, False)
    b = SyncBarrier(3, min_workers=3, round=7)
    assert (b.num_workers, b.min_workers, b.round) == (3, 3, 7)
    assert b.check("a", 6, "s").verdict is Verdict.STALE
    assert b.check("a", 8, "s").verdict is Verdict.FUTURE
    assert b.check("a", 7, "s").verdict is Verdict.ACCEPT


# --- round 0 opening ---------------------------------------------------------------------------


def test_round0_opens_only_when_num_workers_registered() -> None:
    b = SyncBarrier(3)
    b.on_register({"a"})
    assert not b.opened
    b.on_register({"a", "b"})
    assert not b.opened and b.expected == set()
    b.on_register({"a", "b", "c"})
    assert b.opened
    assert b.expected == {"a", "b", "c"}
    assert b.round == 0


def test_round0_opens_with_every_live_worker_when_more_than_num_workers() -> None:
    b = SyncBarrier(2)
    b.on_register({"a", "b", "c"})
    assert b.opened and b.expected == {"a", "b", "c"}


def test_registration_dropping_below_num_workers_before_open_does_not_open() -> None:
    b = SyncBarrier(2)
    b.on_register({"a"})
    b.on_leave("a")
    b.on_register({"b"})
    assert not b.opened


def test_submissions_before_open_are_held_and_round_closes_only_after_opening() -> None:
    b = SyncBarrier(2)
    b.on_register({"a"})
    submit(b, "a", "a-0")
    assert b.submitted == {"a": "a-0"}
    # Every known worker has submitted and min_workers=1 is met, but the round has not opened.
    assert not b.ready()
    b.on_register({"a", "b"})
    assert b.opened and b.expected == {"a", "b"}
    assert b.submitted == {"a": "a-0"}  # the early submission is still counted
    assert not b.ready()  # b has not submitted yet
    submit(b, "b", "b-0")
    assert b.ready()
    assert close_round(b, {"a", "b"}) == 0
    assert b.round == 1
    assert b.submitted == {}


def test_early_submitter_that_leaves_before_open_keeps_its_contribution() -> None:
    b = SyncBarrier(2)
    b.on_register({"a"})
    submit(b, "a", "a-0")
    b.on_leave("a")
    b.on_register({"b", "c"})
    assert b.opened and b.expected == {"b", "c"}
    submit(b, "b", "b-0")
    assert not b.ready()
    submit(b, "c", "c-0")
    assert b.ready()
    assert set(b.submitted) == {"a", "b", "c"}


def test_after_open_registration_does_not_reopen_or_grow_expected() -> None:
    b = opened(2, {"a", "b"})
    b.on_register({"a", "b", "c"})
    assert b.expected == {"a", "b"}


# --- expected set ------------------------------------------------------------------------------


def test_late_joiner_is_not_expected_this_round_and_expected_in_the_next() -> None:
    b = opened(2, {"a", "b"})
    b.on_register({"a", "b", "c"})
    check = b.check("c", 0, "c-0")
    assert check == Check(Verdict.NOT_EXPECTED, 0)
    # The refusal left no trace: c is neither uploading nor submitted.
    assert "c" not in b.uploading and "c" not in b.submitted
    submit(b, "a", "a-0")
    assert not b.ready()  # c's absence does not matter, b's does
    submit(b, "b", "b-0")
    assert b.ready()  # c was never expected
    close_round(b, {"a", "b", "c"})
    assert b.round == 1
    assert b.expected == {"a", "b", "c"}
    assert b.check("c", 1, "c-1").verdict is Verdict.ACCEPT
    submit(b, "a", "a-1")
    submit(b, "b", "b-1")
    assert not b.ready()  # now c is expected
    submit(b, "c", "c-1")
    assert b.ready()


def test_next_rounds_expected_set_is_the_live_set_at_advance() -> None:
    b = opened(2, {"a", "b"})
    submit(b, "a", "a-0")
    submit(b, "b", "b-0")
    b.begin_close()
    b.advance({"b", "d"})
    assert b.expected == {"b", "d"}
    assert b.check("a", 1, "a-1").verdict is Verdict.NOT_EXPECTED


# --- leaving -----------------------------------------------------------------------------------


def test_leave_before_submitting_releases_the_round() -> None:
    b = opened(2, {"a", "b"})
    submit(b, "a", "a-0")
    assert not b.ready()
    b.on_leave("b")
    assert b.expected == {"a"}
    assert b.ready()


def test_leave_after_submitting_keeps_the_contribution() -> None:
    b = opened(2, {"a", "b"}, min_workers=2)
    submit(b, "a", "a-0")
    b.on_leave("a")
    assert b.submitted == {"a": "a-0"}
    assert "a" in b.expected
    assert not b.ready()  # b still expected
    submit(b, "b", "b-0")
    assert b.ready()  # two contributions: min_workers=2 is met with a's kept one
    assert len(b.submitted) == 2


def test_everyone_leaving_without_submitting_does_not_close() -> None:
    b = opened(2, {"a", "b"})
    b.on_leave("a")
    b.on_leave("b")
    assert b.expected == set()
    assert not b.ready()  # zero contributions < min_workers
    assert b.short()


def test_leave_during_upload_drops_the_upload_and_the_expectation() -> None:
    b = opened(2, {"a", "b"})
    submit(b, "a", "a-0")
    assert b.check("b", 0, "b-0").verdict is Verdict.ACCEPT
    b.begin_upload("b", "b-0")
    assert not b.ready()
    b.on_leave("b")
    assert b.uploading == {}
    assert b.expected == {"a"}
    assert b.ready()


def test_leave_of_unknown_worker_is_harmless() -> None:
    b = opened(1, {"a"})
    before = b.public()
    b.on_leave("zzz")
    assert b.public() == before


# --- min_workers and the short-round rescue ----------------------------------------------------


def test_never_closes_below_min_workers() -> None:
    b = opened(3, {"a", "b", "c"}, min_workers=2)
    submit(b, "a", "a-0")
    b.on_leave("b")
    b.on_leave("c")
    assert b.expected == {"a"}
    assert b.short()
    assert not b.ready()
    with pytest.raises(AssertionError):
        b.begin_close()


def test_outsider_is_refused_until_the_round_is_short() -> None:
    b = opened(3, {"a", "b", "c"}, min_workers=2)
    submit(b, "a", "a-0")
    b.on_leave("b")
    # c is still expected: the round is not short, so d (joined late) is refused.
    assert not b.short()
    assert b.check("d", 0, "d-0").verdict is Verdict.NOT_EXPECTED
    b.on_leave("c")
    assert b.short()
    assert b.check("d", 0, "d-0").verdict is Verdict.ACCEPT


def test_short_round_rescue_lets_an_outsider_complete_it() -> None:
    b = opened(3, {"a", "b", "c"}, min_workers=2)
    submit(b, "a", "a-0")
    b.on_leave("b")
    b.on_leave("c")
    b.on_register({"a", "d"})
    assert b.check("d", 0, "d-0").verdict is Verdict.ACCEPT
    b.begin_upload("d", "d-0")
    assert not b.ready()  # an upload in flight holds the close
    b.record("d", "d-0")
    assert not b.short()
    assert b.ready()
    assert close_round(b, {"a", "d"}) == 0
    assert b.expected == {"a", "d"}


def test_short_round_rescue_accepts_only_as_many_as_needed() -> None:
    b = opened(2, {"a", "b"}, min_workers=2)
    submit(b, "a", "a-0")
    b.on_leave("b")
    submit(b, "d", "d-0")  # rescue
    assert not b.short()
    assert b.check("e", 0, "e-0").verdict is Verdict.NOT_EXPECTED


def test_short_is_false_before_open() -> None:
    b = SyncBarrier(2, min_workers=2)
    b.on_register({"a"})
    assert not b.short()


# --- verdicts ----------------------------------------------------------------------------------


def test_stale_and_future_rounds() -> None:
    b = opened(1, {"a"})
    submit(b, "a", "a-0")
    close_round(b, {"a"})
    assert b.check("a", 0, "a-late") == Check(Verdict.STALE, 1)
    assert b.check("a", 2, "a-ahead") == Check(Verdict.FUTURE, 1)
    assert b.check("a", 99, "a-ahead") == Check(Verdict.FUTURE, 1)
    assert b.check("a", 1, "a-1") == Check(Verdict.ACCEPT, 1)


def test_future_round_before_round0_opens() -> None:
    b = SyncBarrier(2)
    b.on_register({"a"})
    assert b.check("a", 1, "s").verdict is Verdict.FUTURE


def test_duplicate_in_the_same_round() -> None:
    b = opened(2, {"a", "b"})
    submit(b, "a", "a-0")
    assert b.check("a", 0, "a-0") == Check(Verdict.DUPLICATE, 0, 0)
    # A duplicate is recognised whatever round the retry names and whoever it claims to be from.
    assert b.check("a", 5, "a-0") == Check(Verdict.DUPLICATE, 0, 0)
    assert b.check("b", 0, "a-0") == Check(Verdict.DUPLICATE, 0, 0)
    assert b.submitted == {"a": "a-0"}


def test_duplicate_after_the_round_advanced_reports_where_it_was_counted() -> None:
    b = opened(1, {"a"})
    submit(b, "a", "a-0")
    close_round(b, {"a"})
    submit(b, "a", "a-1")
    close_round(b, {"a"})
    assert b.round == 2
    assert b.check("a", 0, "a-0") == Check(Verdict.DUPLICATE, 2, 0)
    assert b.check("a", 1, "a-1") == Check(Verdict.DUPLICATE, 2, 1)


def test_duplicate_is_recognised_while_closing() -> None:
    b = opened(1, {"a"})
    submit(b, "a", "a-0")
    b.begin_close()
    assert b.check("a", 0, "a-0") == Check(Verdict.DUPLICATE, 0, 0)


def test_duplicate_falls_back_to_the_current_round_when_history_forgot() -> None:
    b = opened(2, {"a", "b"})
    b.HISTORY = 0  # forget every id at once
    submit(b, "a", "a-0")
    assert b.history == {}
    assert b.check("a", 0, "a-0") == Check(Verdict.DUPLICATE, 0, 0)


def test_history_is_bounded_and_forgets_oldest_first() -> None:
    b = opened(1, {"a"})
    b.HISTORY = 2
    for r in range(4):
        submit(b, "a", f"s{r}")
        close_round(b, {"a"})
    assert list(b.history) == ["s2", "s3"]
    assert b.history == {"s2": 2, "s3": 3}
    assert b.check("a", 0, "s0").verdict is Verdict.STALE  # forgotten: judged as new
    assert b.check("a", 2, "s2") == Check(Verdict.DUPLICATE, 4, 2)


def test_different_submission_from_a_worker_that_submitted_is_already_submitted() -> None:
    b = opened(2, {"a", "b"})
    submit(b, "a", "a-0")
    assert b.check("a", 0, "a-0-bis") == Check(Verdict.ALREADY_SUBMITTED, 0)


def test_second_upload_while_one_is_in_progress() -> None:
    b = opened(2, {"a", "b"})
    assert b.check("a", 0, "a-0").verdict is Verdict.ACCEPT
    b.begin_upload("a", "a-0")
    assert b.check("a", 0, "a-0-bis") == Check(Verdict.IN_PROGRESS, 0)
    # The same id again while it is still being received is not yet a duplicate.
    assert b.check("a", 0, "a-0") == Check(Verdict.IN_PROGRESS, 0)
    # Other workers are unaffected.
    assert b.check("b", 0, "b-0").verdict is Verdict.ACCEPT
    b.record("a", "a-0")
    assert b.uploading == {}
    assert b.check("a", 0, "a-0").verdict is Verdict.DUPLICATE


def test_abort_upload_leaves_no_trace() -> None:
    b = opened(2, {"a", "b"})
    before = b.public()
    history_before = dict(b.history)
    assert b.check("a", 0, "a-0").verdict is Verdict.ACCEPT
    b.begin_upload("a", "a-0")
    assert b.uploading == {"a": "a-0"}
    b.abort_upload("a", "a-0")
    assert b.public() == before
    assert dict(b.history) == history_before
    # The same id may be sent again and counts as new.
    assert b.check("a", 0, "a-0") == Check(Verdict.ACCEPT, 0)
    submit(b, "a", "a-0")
    assert b.submitted == {"a": "a-0"}


def test_abort_of_another_submission_id_keeps_the_running_upload() -> None:
    b = opened(1, {"a"})
    b.begin_upload("a", "a-0")
    b.abort_upload("a", "other")
    assert b.uploading == {"a": "a-0"}
    b.abort_upload("zzz", "a-0")
    assert b.uploading == {"a": "a-0"}


def test_record_without_begin_upload_is_a_programming_error() -> None:
    b = opened(1, {"a"})
    with pytest.raises(AssertionError):
        b.record("a", "a-0")


def test_closing_while_the_outer_step_runs() -> None:
    b = opened(2, {"a", "b"})
    b.on_register({"a", "b", "c"})
    submit(b, "a", "a-0")
    submit(b, "b", "b-0")
    assert b.ready()
    assert b.begin_close() == 0
    assert b.closing
    assert not b.ready()  # not twice
    assert b.check("c", 0, "c-0") == Check(Verdict.CLOSING, 0)
    assert b.check("a", 0, "a-0-bis") == Check(Verdict.CLOSING, 0)
    # Stale and future come before closing.
    assert b.check("c", 1, "c-1") == Check(Verdict.FUTURE, 0)
    b.advance({"a", "b", "c"})
    assert not b.closing
    assert b.round == 1
    assert b.check("c", 0, "c-0") == Check(Verdict.STALE, 1)
    assert b.check("c", 1, "c-1").verdict is Verdict.ACCEPT


def test_ready_needs_no_upload_in_flight() -> None:
    b = opened(2, {"a", "b"}, min_workers=2)
    submit(b, "a", "a-0")
    b.on_leave("b")
    assert b.short()
    # Two outsiders are both let in while the round is short; the first completes it, but the
    # round waits for the second upload to finish or fail before closing.
    assert b.check("d", 0, "d-0").verdict is Verdict.ACCEPT
    b.begin_upload("d", "d-0")
    assert b.check("e", 0, "e-0").verdict is Verdict.ACCEPT
    b.begin_upload("e", "e-0")
    b.record("d", "d-0")
    assert not b.ready()
    b.abort_upload("e", "e-0")
    assert b.ready()
    assert set(b.submitted) == {"a", "d"}


def test_public_view() -> None:
    b = opened(2, {"b", "a"})
    submit(b, "b", "b-0")
    b.begin_upload("a", "a-0")
    assert b.public() == {
        "round": 0,
        "opened": True,
        "num_workers": 2,
        "min_workers": 1,
        "expected": ["a", "b"],
        "submitted": ["b"],
        "uploading": ["a"],
        "closing": False,
    }


def test_many_rounds_with_churn() -> None:
    """A longer scripted run: membership changes between rounds, each round closes exactly when
    its own expected set is done."""
    b = opened(2, {"a", "b"})
    live = {"a", "b"}
    for r in range(6):
        assert b.round == r
        joiner = f"j{r}"
        live.add(joiner)
        b.on_register(set(live))
        assert b.check(joiner, r, f"{joiner}-{r}").verdict is Verdict.NOT_EXPECTED
        expected = sorted(b.expected)
        for w in expected[:-1]:
            submit(b, w, f"{w}-{r}")
            assert not b.ready()
        submit(b, expected[-1], f"{expected[-1]}-{r}")
        assert b.ready()
        if r % 2:
            live.discard(expected[0])
            b.on_leave(expected[0])
        close_round(b, set(live))
        assert b.expected == live
