"""The quorum book's record of the members the checks left out (server/allreduce/quorum_book.py
``note_excluded``, ``consecutive_exclusions``; counted in server/allreduce/exclusions.py):
counted once per quorum, reset by a completed quorum that admitted the member or by its
registration, shown in the status summary."""

from __future__ import annotations

import logging

import pytest

from diloco.server.allreduce.quorum_book import QuorumBook
from diloco.server.observe.records import WorkerExclusions
from diloco.wire.messages import QuorumAsk, QuorumOutcome
from tests.helpers.clock import FakeClock

MEMBERS = ("w0", "w1", "w2")


def book() -> QuorumBook:
    return QuorumBook(
        instance="i0",
        live=lambda: set(MEMBERS),
        clock=FakeClock(),
        min_workers=3,
        num_workers=3,
        rendezvous=("127.0.0.1", 29400),
    )


def round_(b: QuorumBook, r: int, excluded: tuple[str, ...], ok: bool = True) -> str:
    """A quorum of the three at round ``r``; every member reports ``excluded`` (w0 fails
    instead of reporting ok when not ``ok``). Returns its id."""
    tickets = [b.ask(QuorumAsk(w, r, f"h{r}", True)) for w in MEMBERS]
    assert tickets[0].reply is not None
    qid = tickets[0].reply.quorum_id
    for w in MEMBERS:
        failed = not ok and w == "w0"
        outcome = (
            QuorumOutcome(w, qid, False, error="x", stage="check", excluded=excluded)
            if failed
            else QuorumOutcome(w, qid, True, r + 1, f"h{r + 1}", excluded=excluded)
        )
        b.report(outcome)
        if failed:
            break
    return qid


def test_exclusions_are_counted_once_per_quorum_and_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    b = book()
    with caplog.at_level(logging.WARNING, logger="diloco.server.allreduce.exclusions"):
        qid = round_(b, 0, ("w2",))
    warnings = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
    assert warnings == [
        f"quorum {qid} left out w2 (1 in a row) (a non-finite pseudo-gradient, a norm far above "
        "the quorum's median, or a weight out of bounds; the members' logs say which)"
    ]
    assert b.excluded_rounds == {"w2": 1} and b.consecutive_exclusions("w2") == 1
    assert b.consecutive_exclusions("w0") == 0
    summary = b.public()
    assert summary.excluded_last == ("w2",)
    assert summary.excluded_rounds == (WorkerExclusions("w2", 1, 1),)


def test_in_a_row_grows_and_is_reset_by_an_admitting_quorum_or_a_registration() -> None:
    b = book()
    round_(b, 0, ("w2",))
    round_(b, 1, ("w2", "w1"))
    assert b.consecutive_exclusions("w2") == 2 and b.consecutive_exclusions("w1") == 1
    round_(b, 2, ("w2",))  # w1 admitted by a completed quorum: its run ends
    assert b.consecutive_exclusions("w2") == 3 and b.consecutive_exclusions("w1") == 0
    assert b.excluded_rounds == {"w2": 3, "w1": 1}  # the totals stay
    b.registered("w2")
    assert b.consecutive_exclusions("w2") == 0 and b.excluded_rounds["w2"] == 3
    assert b.public().excluded_rounds == (
        WorkerExclusions("w1", 1, 0),
        WorkerExclusions("w2", 3, 0),
    )


def test_a_discarded_quorum_does_not_reset_and_strangers_named_are_ignored() -> None:
    b = book()
    round_(b, 0, ("w2",))
    round_(b, 1, ("w2", "intruder"), ok=False)  # discarded: nobody admitted anyone
    assert b.rounds_discarded == 1
    assert b.consecutive_exclusions("w2") == 2
    assert "intruder" not in b.excluded_rounds
    round_(b, 1, ())  # completed, nobody left out: w2's run ends
    assert b.consecutive_exclusions("w2") == 0 and b.excluded_last == ("w2",)
