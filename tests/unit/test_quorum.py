"""All-reduce mode's quorums (server/allreduce/quorum_book.py) with a fake clock: when a quorum
forms, where it starts (round, hash, source, resync), how outcomes complete or discard it, and the
errors."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from diloco.server.allreduce.agreement import learn
from diloco.server.allreduce.quorum_book import QuorumBook
from diloco.server.allreduce.quorum_records import Choice, choose
from diloco.server.allreduce.waiting import Ticket
from diloco.server.errors import ApiError
from diloco.wire import WireError
from diloco.wire.messages import QuorumAsk as Ask
from diloco.wire.messages import QuorumOutcome as Outcome
from diloco.wire.messages import Rendezvous
from tests.helpers.clock import FakeClock

RENDEZVOUS = Rendezvous(path="/rendezvous")


class Run:
    """A book over a set of live workers and a fake clock."""

    def __init__(self, *workers: str, **settings: Any) -> None:
        self.clock = FakeClock()
        self.live = set(workers)
        self.forgotten: list[str] = []
        settings.setdefault("join_timeout", 15.0)
        self.book = QuorumBook(
            instance="i0",
            live=lambda: set(self.live),
            clock=self.clock,
            collective_timeout=10.0,
            poll_margin=5.0,
            rendezvous=RENDEZVOUS,
            **settings,
        )
        self.book.forget = self.forgotten.append

    def ask(self, worker: str, round_: int = 0, hash_: str = "h0", **kw: Any) -> Ticket:
        has_state = kw.get("has_state", bool(hash_))
        return self.book.ask(Ask(worker, round_, hash_, has_state))

    def report(
        self, worker: str, qid: str, ok: bool = True, round_: int = 1, hash_: str = "h1"
    ) -> dict[str, Any]:
        return self.book.report(
            Outcome(worker, qid, ok, round_ if ok else None, hash_, "boom")
        ).to_json()

    def leave(self, worker: str) -> None:
        self.live.discard(worker)
        self.book.on_leave(worker)


def reply(ticket: Ticket) -> dict[str, Any]:
    assert ticket.done and ticket.reply is not None
    return ticket.reply.to_json()


def formed(run: Run, *workers: str, round_: int = 0) -> str:
    """Every worker asks at ``round_`` with the same hash; returns the quorum's id."""
    tickets = [run.ask(w, round_, f"h{round_}") for w in workers]
    return str(reply(tickets[0])["quorum_id"])


def api_error(call: Any, *args: Any) -> ApiError | WireError:
    """The error ``call`` raises: the book's (``ApiError``), or a body's that does not read
    (``MessageError``, a ``WireError``)."""
    with pytest.raises((ApiError, WireError)) as info:
        call(*args)
    return info.value


read_ask, read_outcome = Ask.from_json, Outcome.from_json


# --- forming --------------------------------------------------------------------------------


def test_a_quorum_forms_when_every_live_worker_asks_with_ranks_by_id() -> None:
    run = Run("b", "a")
    tb = run.ask("b")
    assert not tb.done and run.book.pending() == ("b",)
    ta = run.ask("a")
    qa, qb = reply(ta), reply(tb)
    assert (qa["rank"], qb["rank"]) == (0, 1)
    assert qa["members"] == qb["members"] == ["a", "b"]
    assert qa["quorum_id"] == qb["quorum_id"] == "i0-1"
    assert qa["size"] == 2 and qa["timeout"] == 10.0 and qa["save"] is False
    assert qa["rendezvous"] == {"path": "/rendezvous"}
    status = run.book.public()
    assert status.quorum is not None and status.quorum.members == ("a", "b")
    assert status.pending_quorum == ()


def test_a_quorum_waits_for_live_workers_until_join_timeout_then_needs_min_workers() -> None:
    run = Run("a", "b", "c", min_workers=2)
    ta = run.ask("a")
    run.clock.now += 14.0
    run.book.tick()
    assert not ta.done  # c and b are live and not asking yet
    tb = run.ask("b")
    run.clock.now += 1.0  # join_timeout since a's request
    run.book.tick()
    assert reply(ta)["members"] == reply(tb)["members"] == ["a", "b"]


def test_join_timeout_never_forms_a_quorum_below_min_workers_or_when_zero() -> None:
    run = Run("a", "b", min_workers=2)
    ta = run.ask("a")
    run.clock.now += 100.0
    run.book.tick()
    assert not ta.done
    run = Run("a", "b", join_timeout=0.0)
    ta = run.ask("a")
    run.clock.now += 1000.0
    run.book.tick()
    assert not ta.done  # 0: wait for every live worker


def test_the_first_quorum_of_a_fresh_run_waits_for_num_workers() -> None:
    run = Run("a", num_workers=2)
    ta = run.ask("a")
    run.clock.now += 100.0
    run.book.tick()
    assert not ta.done  # alone and every live worker asking, but the run expects two
    run.live.add("b")
    run.ask("b")
    assert reply(ta)["size"] == 2
    # After a restart the workers present their rounds: no longer a fresh run.
    run = Run("a", num_workers=2)
    assert reply(run.ask("a", 7, "h7"))["round"] == 7


def test_a_leaving_worker_lets_the_others_form_and_a_pending_one_gets_410() -> None:
    run = Run("a", "b")
    ta = run.ask("a")
    run.leave("b")
    assert reply(ta)["members"] == ["a"]
    run = Run("a", "b")
    tb = run.ask("b")
    run.leave("b")
    assert tb.done and tb.gone
    err = api_error(asyncio.run, run.book.wait(tb, 1.0))
    assert (err.status, err.code) == (410, "unknown_worker")


def test_unknown_workers_get_410_and_no_quorum_forms_without_state() -> None:
    run = Run("a", "b")
    assert api_error(run.ask, "zed").status == 410
    ta, tb = run.ask("a", 0, ""), run.ask("b", 0, "h", has_state=False)
    assert not ta.done and not tb.done  # nobody can hand out a state
    run.live.add("c")
    tc = run.ask("c", 3, "h3")
    q = reply(ta)
    assert (q["round"], q["hash"], q["source"], q["resync"]) == (3, "h3", 2, [0, 1])
    assert reply(tc)["rank"] == 2


def test_no_second_quorum_forms_while_one_is_open() -> None:
    run = Run("a", "b")
    qid = formed(run, "a", "b")
    run.live.add("c")
    tc = run.ask("c")
    run.clock.now += 20.0  # past join_timeout, before the open quorum's deadline (35 s)
    run.book.tick()
    assert not tc.done and run.book.open is not None and run.book.open.id == qid


def test_a_quorum_that_ended_lets_the_next_form_only_after_join_timeout_for_latecomers() -> None:
    run = Run("a", "b")
    qid = formed(run, "a", "b")
    run.live.add("c")
    tc = run.ask("c")
    run.clock.now += 20.0
    run.report("a", qid)
    ta = run.ask("a", 1, "h1")  # right after: c has waited > join_timeout, but b has not asked
    assert not ta.done and not tc.done
    run.report("b", qid)
    tb = run.ask("b", 1, "h1")
    assert reply(ta)["members"] == ["a", "b", "c"] and reply(tb)["resync"] == [2]


# --- where a quorum starts ------------------------------------------------------------------


def asks(*states: tuple[int, str]) -> list[Ask]:
    return [Ask(f"w{i}", r, h, bool(h)) for i, (r, h) in enumerate(states)]


def test_the_start_is_the_highest_round_and_its_most_common_hash() -> None:
    got = choose(asks((2, "x"), (3, "y"), (3, "z"), (3, "z"), (0, "")))
    assert got == Choice(round=3, hash="z", source=2, resync=(0, 1, 4))


def test_a_tie_goes_to_the_lowest_rank_and_an_agreed_hash_wins() -> None:
    assert choose(asks((1, "b"), (1, "a"))) == Choice(1, "b", 0, (1,))
    assert choose(asks((1, "b"), (1, "a"), (1, "a")), agreed=(1, "b")) == Choice(1, "b", 0, (1, 2))
    assert choose(asks((1, "b"), (1, "a")), agreed=(0, "a")).hash == "b"  # another round's
    assert choose(asks((0, "a"), (0, "a"))) == Choice(0, "a", 0, ())


def test_a_joiner_without_state_is_resynced_even_with_a_round() -> None:
    joiner = Ask("w1", 5, "x", has_state=False)
    assert choose([Ask("w0", 4, "y", True), joiner]) == Choice(4, "y", 0, (1,))


# --- outcomes -------------------------------------------------------------------------------


def test_all_ok_with_the_same_hash_completes_the_round() -> None:
    run = Run("a", "b")
    qid = formed(run, "a", "b")
    assert run.report("a", qid) == {"status": "recorded", "quorum_id": qid, "round": 0}
    assert run.book.open is not None and run.book.rounds_completed == 0
    assert run.report("b", qid)["round"] == 1
    status = run.book.public()
    assert (status.round, status.rounds_completed, status.quorum) == (1, 1, None)
    assert run.forgotten == [qid]
    assert run.report("b", qid)["status"] == "recorded"  # a retried report: same answer
    # The next quorum starts from the agreed state.
    q = reply(formed_ticket(run, ("a", 1, "h1"), ("b", 1, "h1")))
    assert (q["round"], q["hash"], q["resync"]) == (1, "h1", [])


def formed_ticket(run: Run, *asks_: tuple[str, int, str]) -> Ticket:
    tickets = [run.ask(w, r, h) for w, r, h in asks_]
    return tickets[0]


def test_a_quorum_where_no_step_was_taken_closes_without_a_round() -> None:
    run = Run("a", "b")
    qid = formed(run, "a", "b")
    run.report("a", qid, round_=0, hash_="h0")
    run.report("b", qid, round_=0, hash_="h0")
    assert run.book.open is None and run.book.rounds_completed == 0 and run.book.round == 0


def test_a_diverged_hash_is_outvoted_and_resynced_at_the_next_quorum() -> None:
    run = Run("a", "b", "c")
    qid = formed(run, "a", "b", "c")
    run.report("a", qid, hash_="bad")
    run.report("b", qid)
    run.report("c", qid)
    assert run.book.round == 1 and run.book.rounds_completed == 1
    # Next time a presents its diverged hash against one member only: the agreed one wins.
    run.leave("c")
    ta, tb = run.ask("a", 1, "bad"), run.ask("b", 1, "h1")
    assert (reply(ta)["hash"], reply(ta)["source"], reply(tb)["resync"]) == ("h1", 1, [0])


def test_a_failure_discards_the_quorum_and_keeps_the_round() -> None:
    run = Run("a", "b")
    qid = formed(run, "a", "b")
    run.report("a", qid)
    assert run.report("b", qid, ok=False)["status"] == "recorded"
    assert (run.book.open, run.book.rounds_discarded, run.book.round) == (None, 1, 0)
    late = run.report("a", qid)
    assert late["status"] == "discarded" and "b failed: boom" in late["detail"]
    assert run.forgotten == []  # its keys go when a later quorum completes
    qid2 = formed(run, "a", "b")
    run.report("a", qid2)
    run.report("b", qid2)
    assert run.forgotten == [qid, qid2]


def test_an_eviction_discards_the_quorum_unless_the_member_had_reported() -> None:
    run = Run("a", "b", "c")
    qid = formed(run, "a", "b", "c")
    run.report("c", qid)
    run.leave("c")  # it finished and left: the round goes on
    assert run.book.open is not None
    run.leave("b")
    assert run.book.open is None and run.book.rounds_discarded == 1


def test_the_deadline_discards_a_quorum_without_outcomes() -> None:
    run = Run("a", "b")
    qid = formed(run, "a", "b")
    run.report("a", qid)
    run.clock.now += 3 * 10.0 + 5.0 - 0.1
    run.book.tick()
    assert run.book.open is not None
    run.clock.now += 0.1
    run.book.tick()
    assert run.book.open is None and run.book.rounds_discarded == 1
    assert "no outcome from b" in run.report("b", qid)["detail"]


def test_a_member_asking_again_before_reporting_discards_its_quorum() -> None:
    run = Run("a", "b")
    qid = formed(run, "a", "b")
    run.report("a", qid)
    ta = run.ask("a", 1, "h1")  # reported: waits for the next quorum, nothing discarded
    assert run.book.open is not None and not ta.done
    tb = run.ask("b", 0, "h0")  # b failed without reporting and retries
    assert run.book.rounds_discarded == 1
    q = reply(tb)
    # a alone (1 of 2, no strict majority) applied the discarded quorum's step: its state is not
    # agreed, so the quorum starts from the agreed round 0 (b), and a receives it.
    assert q["quorum_id"] == "i0-2" and (q["round"], q["source"], q["resync"]) == (0, 1, [0])


def test_outcome_errors() -> None:
    run = Run("a", "b")
    qid = formed(run, "a", "b")
    run.live.add("c")
    assert (api_error(run.report, "a", "i0-99").status, api_error(run.report, "a", "x").code) == (
        404,
        "unknown_quorum",
    )
    err = api_error(run.report, "c", qid)
    assert (err.status, err.code) == (409, "not_a_member")
    assert api_error(run.report, "zed", qid).status == 410
    err = api_error(run.report, "a", qid, True, 5)
    assert (err.status, err.code) == (400, "bad_field")
    assert run.book.open is not None and not run.book.open.outcomes  # refused: nothing changed


# --- saves, waits, bodies -------------------------------------------------------------------


def test_save_every_and_a_requested_save_that_survives_a_discard() -> None:
    run = Run("a", save_every=2)
    q = reply(run.ask("a", 0, "h0"))
    assert q["save"] is False  # round 0 -> 1
    run.report("a", q["quorum_id"], round_=1, hash_="h1")
    q = reply(run.ask("a", 1, "h1"))
    assert q["save"] is True  # round 1 -> 2
    run.report("a", q["quorum_id"], round_=2, hash_="h2")
    assert run.book.request_save().to_json() == {"status": "requested", "round": 2}
    qid = str(reply(run.ask("a", 2, "h2"))["quorum_id"])
    run.report("a", qid, ok=False)
    assert reply(run.ask("a", 2, "h2"))["save"] is True


def test_a_wait_that_times_out_withdraws_the_request() -> None:
    run = Run("a", "b")

    async def main() -> tuple[dict[str, Any] | None, tuple[str, ...]]:
        ticket = run.ask("a")
        got = await run.book.wait(ticket, 0.01)
        return got, run.book.pending()

    assert asyncio.run(main()) == (None, ())
    older = run.ask("a")
    run.ask("a")  # the same worker again (its read timed out): the older request ends
    assert older.done and older.reply is None and run.book.pending() == ("a",)


def test_request_bodies_are_checked() -> None:
    assert read_ask({"worker_id": "a", "round": 2, "hash": "h"}) == Ask("a", 2, "h", True)
    assert read_ask({"worker_id": "a", "round": 0, "hash": ""}).holds is False
    for bad in ({"round": 0}, {"worker_id": "a", "round": -1}, {"worker_id": "a", "round": True},
                {"worker_id": "a", "round": 0, "hash": 5},
                {"worker_id": "a", "round": 0, "has_state": "yes"}):  # fmt: skip
        assert api_error(read_ask, bad).code == "bad_field"
    ok = {"worker_id": "a", "quorum_id": "q", "ok": True, "round": 1, "hash": "h"}
    assert read_outcome(ok) == Outcome("a", "q", True, 1, "h", "")
    failed = read_outcome({"worker_id": "a", "quorum_id": "q", "ok": False, "error": "x" * 900})
    assert failed.round is None and len(failed.error) == 500
    for key in ("ok", "round", "hash", "quorum_id"):
        assert api_error(read_outcome, {k: v for k, v in ok.items() if k != key}).code == (
            "bad_field"
        )


def test_stale_workers_wait_for_a_live_holder_of_the_runs_state() -> None:
    """Round 1 completed with hash h1. A worker that missed it (round 0) asks alone: no quorum
    forms while a live worker that may hold h1 has not asked, even past join_timeout; it forms
    with that worker, which becomes the source, and the stale one resyncs."""
    run = Run("a", "b", min_workers=1)
    qid = formed(run, "a", "b")
    run.report("a", qid)
    run.report("b", qid)
    stale = run.ask("b", 0, "h0")
    run.clock.now += 100.0
    run.book.tick()
    assert not stale.done
    holder = run.ask("a", 1, "h1")
    got = reply(stale)
    assert reply(holder)["quorum_id"] == got["quorum_id"]
    assert (got["round"], got["hash"], got["source"], got["resync"]) == (1, "h1", 0, [1])


def test_when_no_live_worker_holds_the_runs_state_the_best_held_goes_on() -> None:
    run = Run("a", "b", min_workers=1)
    qid = formed(run, "a", "b")
    run.report("a", qid)
    run.report("b", qid)
    run.leave("a")  # the only holders of round 1 are gone
    got = reply(run.ask("b", 0, "h0"))
    assert (got["round"], got["resync"]) == (0, [])


def test_a_server_started_into_a_run_waits_for_its_workers_before_one_goes_on_alone() -> None:
    """Restarted: the first worker back (round 5) does not form a quorum alone while
    ``resume_grace`` lasts; the second one back forms it with both; after the grace a lone
    worker goes on."""
    run = Run("a", num_workers=2, resume_grace=10.0)
    first = run.ask("a", 5, "h5")
    assert not first.done
    run.live.add("b")
    both = run.ask("b", 5, "h5")
    assert reply(first)["members"] == reply(both)["members"] == ["a", "b"]

    late = Run("a", num_workers=2, resume_grace=10.0)
    alone = late.ask("a", 5, "h5")
    late.clock.now += 9.0
    late.book.tick()
    assert not alone.done
    late.clock.now += 2.0
    late.book.tick()
    assert reply(alone)["members"] == ["a"]


# --- members gone silent after a failed quorum (server/allreduce/suspects.py) ---------------


class Beats:
    """Each worker's last-seen time and heartbeat interval, as the registry would tell them."""

    def __init__(self, interval: float) -> None:
        self.clock = FakeClock()  # replaced by the run's
        self.seen: dict[str, float] = {}
        self.interval = interval

    def beat(self, worker: str) -> None:
        self.seen[worker] = self.clock.now

    def __call__(self, worker: str) -> tuple[float, float] | None:
        return self.seen.get(worker, 0.0), self.interval


def silent_member_run(interval: float = 1.0) -> tuple[Run, Beats, str]:
    """Quorum of a, b, c at round 0; c dies inside it: a reports the failure, b asks again."""
    beats = Beats(interval)
    run = Run("a", "b", "c", heartbeat_of=beats)
    beats.clock = run.clock
    qid = formed(run, "a", "b", "c")
    for w in "abc":
        beats.beat(w)
    run.clock.now += 0.1
    run.report("a", qid, ok=False)
    return run, beats, qid


def test_a_member_silent_after_a_failed_quorum_is_not_waited_for_after_two_intervals() -> None:
    run, beats, _ = silent_member_run(interval=1.0)
    ta, tb = run.ask("a"), run.ask("b")
    run.clock.now += 2.4  # within two intervals and the margin: c may still speak
    run.book.tick()
    assert not ta.done
    run.clock.now += 0.2
    run.book.tick()
    assert reply(ta)["members"] == reply(tb)["members"] == ["a", "b"]
    assert "c" in run.live  # not evicted: only left out of this quorum


def test_a_member_heard_from_after_the_failure_is_waited_for() -> None:
    run, beats, qid = silent_member_run(interval=1.0)
    ta = run.ask("a")
    run.ask("b")
    run.clock.now += 0.5
    beats.beat("c")  # alive (a heartbeat): its collective is only slower to fail
    run.clock.now += 5.0
    run.book.tick()
    assert not ta.done
    run.report("c", qid, ok=False)  # it failed too, and asks again
    run.ask("c")
    assert reply(ta)["members"] == ["a", "b", "c"]


def test_a_suspect_that_comes_back_counts_again() -> None:
    run, beats, _ = silent_member_run(interval=1.0)
    run.ask("a")
    tb = run.ask("b")
    run.clock.now += 3.0
    run.book.tick()
    qid = str(reply(tb)["quorum_id"])
    run.report("a", qid)
    run.report("b", qid)
    beats.beat("c")
    tc, ta2 = run.ask("c", 0, "h0"), run.ask("a", 1, "h1")
    run.ask("b", 1, "h1")
    assert reply(tc)["members"] == reply(ta2)["members"] == ["a", "b", "c"]
    assert reply(tc)["resync"] == [2]  # it receives the state it missed


def test_without_heartbeats_a_silent_member_is_waited_for_until_its_eviction() -> None:
    run, _, _ = silent_member_run(interval=0.0)
    ta = run.ask("a")
    run.ask("b")
    run.clock.now += 10.0  # below join_timeout (15 s)
    run.book.tick()
    assert not ta.done
    run.leave("c")
    assert reply(ta)["members"] == ["a", "b"]


def test_the_next_quorum_names_the_quorum_that_made_its_starting_state() -> None:
    """b's commit point failed after a's and c's passed: they report their new state to the
    quorum already discarded by b's failure; made by a strict majority of its members, that
    state is agreed: the next quorum starts from it and names that quorum, so b knows its own
    contribution is in it."""
    run = Run("a", "b", "c")
    qid = formed(run, "a", "b", "c")
    run.report("b", qid, ok=False)
    assert run.report("a", qid, round_=1, hash_="h1")["status"] == "discarded"
    assert run.report("c", qid, round_=1, hash_="h1")["status"] == "discarded"
    ta, tb, tc = run.ask("a", 1, "h1"), run.ask("b", 0, "h0"), run.ask("c", 1, "h1")
    assert reply(tb)["made_by"] == reply(ta)["made_by"] == reply(tc)["made_by"] == qid
    assert reply(tb)["resync"] == [1]
    # A start no member reported making (a fresh run's) names none.
    fresh = Run("a")
    assert reply(fresh.ask("a"))["made_by"] == ""


# --- issue 26: only agreed states are a source; who is left out ------------------------------


def fail(run: Run, worker: str, qid: str, stage: str = "join") -> None:
    run.book.report(Outcome(worker, qid, False, error="injected", stage=stage))


def ok(run: Run, worker: str, qid: str, round_: int, hash_: str, excluded: tuple = ()) -> None:
    run.book.report(Outcome(worker, qid, True, round_, hash_, excluded=excluded))


def completed_round(run: Run, workers: str, round_: int) -> None:
    """Every worker asks at ``round_`` (hash ``h<round>``) and reports ``round_ + 1``."""
    qid = formed(run, *workers, round_=round_)
    for w in workers:
        ok(run, w, qid, round_ + 1, f"h{round_ + 1}")


def refusal(run: Run, worker: str, round_: int, hash_: str) -> ApiError:
    error = api_error(run.ask, worker, round_, hash_)
    assert isinstance(error, ApiError) and error.status == 409
    return error


def test_a_claim_the_run_never_agreed_on_is_refused_and_changes_nothing() -> None:
    run = Run("a", "b", "c")
    for r in range(2):
        completed_round(run, "abc", r)
    ta, tb = run.ask("a", 2, "h2"), run.ask("b", 2, "h2")
    before = (run.book.pending(), run.book.open, run.book.round)
    error = refusal(run, "c", 1002, "mine")
    assert error.code == "unagreed_state" and error.reply.action == "rebase"
    assert "round 1002, hash mine" in error.detail and "round 2, hash h2" in error.detail
    assert (run.book.pending(), run.book.open, run.book.round) == before and not ta.done
    # Asking again with no state, it receives the agreed state from a holder.
    qc = reply(run.ask("c", 1002, "", has_state=False))
    assert (qc["round"], qc["hash"], qc["source"], qc["resync"]) == (2, "h2", 0, [2])
    assert reply(ta)["quorum_id"] == reply(tb)["quorum_id"] == qc["quorum_id"]
    # A diverged hash at an agreed round is refused just the same; an older agreed state, or
    # a worker's own round-0 start, is let in and receives the run's state.
    assert refusal(run, "a", 2, "forged").code == "unagreed_state"


def test_only_an_agreed_state_is_a_source_an_older_one_resyncs() -> None:
    run = Run("a", "b", "c")
    completed_round(run, "abc", 0)
    qid = formed(run, "a", "b", "c", round_=1)
    ok(run, "a", qid, 2, "h2")
    ok(run, "b", qid, 2, "h2")
    ok(run, "c", qid, 2, "h2-diverged")  # outvoted, yet reported: let in, never the source
    tc, ta = run.ask("c", 2, "h2-diverged"), run.ask("a", 1, "h1")  # a holds an older state
    run.book.tick()
    assert not tc.done  # b, which holds the last agreed state, is live and not asking yet
    tb = run.ask("b", 2, "h2")
    q = reply(tb)
    assert (q["round"], q["hash"], q["source"], q["resync"]) == (2, "h2", 1, [0, 2])
    assert reply(ta)["quorum_id"] == reply(tc)["quorum_id"] == q["quorum_id"]


def test_a_discarded_quorum_whose_majority_applied_its_step_made_an_agreed_state() -> None:
    """The two generals: 2 of 3 passed the commit point and report after the discard; their
    state is agreed (a source); one member's report alone would not be."""
    run = Run("a", "b", "c")
    qid = formed(run, "a", "b", "c")
    fail(run, "c", qid, stage="commit")
    ok(run, "a", qid, 1, "h1")
    ok(run, "b", qid, 1, "h1")
    tc = run.ask("c", 0, "h0")
    ta, tb = run.ask("a", 1, "h1"), run.ask("b", 1, "h1")
    assert (reply(tc)["round"], reply(tc)["source"], reply(tb)["resync"]) == (1, 0, [2])
    assert reply(ta)["made_by"] == qid


def test_learn_takes_a_strict_majority_else_the_most_common_lower_round_then_rank() -> None:
    def asks(*states: tuple[int, str]) -> list[Ask]:
        return [Ask(f"w{i}", r, h, bool(h)) for i, (r, h) in enumerate(states)]

    assert learn(asks((1005, "x"), (5, "h"), (5, "h"))) == (5, "h")
    assert learn(asks((9, "a"), (9, "a"), (3, "b"))) == (9, "a")  # a majority, even if higher
    assert learn(asks((1005, "x"), (5, "h"))) == (5, "h")  # a tie: the lower round
    assert learn(asks((5, "x"), (5, "h"), (0, ""))) == (5, "x")  # a tie, same round: rank
    assert learn(asks((7, "a"), (7, "a"), (3, "b"), (8, "c"), (9, "d"))) == (7, "a")
    assert learn(asks((0, ""))) is None


@pytest.mark.parametrize("hijacker_first", [True, False])
@pytest.mark.parametrize("n", [2, 3])
def test_a_restarted_server_learns_the_state_from_the_returning_majority(
    n: int, hijacker_first: bool
) -> None:
    """A server without records: its first quorum waits for num_workers, then takes the state
    held by more than half of them (among 3), or on a tie the lower round (among 2): a member
    claiming round + 1000 is never the source, whatever its rank; later it is refused."""
    honest = ["h0", "h1"][: n - 1]
    hijacker = "a" if hijacker_first else "z"
    run = Run(*honest, hijacker, num_workers=n, resume_grace=100.0)
    tickets = {w: run.ask(w, 5, "s5") for w in honest}
    th = run.ask(hijacker, 1005, "forged")
    q = reply(th)
    members = q["members"]
    assert (q["round"], q["hash"]) == (5, "s5")
    assert members[q["source"]] in honest and q["resync"] == [members.index(hijacker)]
    for w in [*honest, hijacker]:
        ok(run, w, str(q["quorum_id"]), 6, "s6")
    assert all(t.done for t in tickets.values())
    assert refusal(run, hijacker, 1006, "forged2").code == "unagreed_state"


def test_an_out_of_range_weight_is_refused_naming_the_field() -> None:
    for weight in (1e300, -1.0, float("nan"), float("inf"), 1e12 * 1.5):
        error = api_error(read_ask, {"worker_id": "a", "round": 0, "hash": "h", "weight": weight})
        assert isinstance(error, WireError) and "weight" in str(error)
    assert read_ask({"worker_id": "a", "round": 0, "hash": "h", "weight": 1e12}).weight == 1e12


def firewalled(run: Run, bad: str, quorums: int) -> list[tuple[str, ...]]:
    """Quorums of whoever is not left out, ``quorums`` times: one with ``bad`` and another
    member fails at its join on every member; any other completes. Returns each quorum's
    members."""
    seen = []
    for _ in range(quorums):
        now = run.clock.now
        asking = [w for w in sorted(run.live) if run.book._left_out.of(w, now) is None]
        tickets = {w: run.ask(w, run.book.round, f"h{run.book.round}") for w in asking}
        run.clock.now += 1.0  # every worker not left out asks: none is waited for
        run.book.tick()
        q = reply(next(t for t in tickets.values() if t.done))
        qid, members = str(q["quorum_id"]), tuple(q["members"])
        seen.append(members)
        if bad in members and len(members) > 1:
            for w in members:
                fail(run, w, qid)
        else:
            for w in members:
                ok(run, w, qid, q["round"] + 1, f"h{q['round'] + 1}")
        for t in tickets.values():  # a worker left out while waiting hears it at once
            if not t.done:
                with pytest.raises(ApiError, match="left out"):
                    asyncio.run(run.book.wait(t, 0.0))
    return seen


def test_a_firewalled_newcomer_is_left_out_after_two_failed_joins_and_the_others_go_on() -> None:
    run = Run("a", "b", left_out_base=60.0)
    for r in range(2):
        completed_round(run, "ab", r)
    run.live.add("c")
    seen = firewalled(run, "c", 4)
    assert seen[:2] == [("a", "b", "c")] * 2 and seen[2:] == [("a", "b")] * 2
    assert run.book.round == 4 and run.book.rounds_discarded == 2
    error = refusal(run, "c", 0, "hc")
    assert error.code == "left_out" and error.reply.action == "continue"
    assert "never completed one" in error.detail
    (shown,) = run.book.public().left_out
    assert shown.worker_id == "c" and 0 < (shown.seconds_left or 0) <= 60.0


def test_a_tie_at_a_fresh_start_converges_and_the_left_out_are_tried_again_with_backoff() -> None:
    """Nobody ever completed a quorum, so the first blames fall on honest workers: a, then c
    once {b, c} fails without a (a's leave ends: it was blamed wrongly), then b (blamed least)
    once {a, b} fails without c. The run then progresses without b, well before any leave ran
    out. The leave runs out (probation); b's next failures leave it out twice as long."""
    run = Run("a", "b", "c", left_out_base=60.0)
    start = run.clock.now
    seen = firewalled(run, "b", 9)
    assert seen[:6] == [("a", "b", "c")] * 2 + [("b", "c")] * 2 + [("a", "b")] * 2
    assert seen[6:] == [("a", "c")] * 3 and run.book.rounds_completed == 3
    assert run.clock.now - start < 60.0  # no leave had to run out: nobody waited for one
    assert [s.worker_id for s in run.book.public().left_out] == ["b"]
    first = run.book._left_out.of("b", run.clock.now)
    assert first is not None
    run.clock.now = first.until  # its leave ran out: tried again
    again = firewalled(run, "b", 3)
    assert "b" in again[0] and "b" in again[1] and "b" not in again[2]
    second = run.book._left_out.of("b", run.clock.now)
    assert second is not None and "120 s" in second.reason  # doubled


def test_a_failed_check_of_the_average_blames_nobody() -> None:
    run = Run("a", "b")
    for _ in range(3):
        qid = formed(run, "a", "b")
        fail(run, "a", qid, stage="check")
    assert run.book.public().left_out == ()


def test_a_worker_excluded_three_rounds_in_a_row_is_left_out_until_it_registers_again() -> None:
    run = Run("a", "b", "c")
    for r in range(3):
        qid = formed(run, "a", "b", "c", round_=r)
        for w in "abc":
            ok(run, w, qid, r + 1, f"h{r + 1}", excluded=("c",) if r != 1 or w != "a" else ())
        assert run.book.consecutive_exclusions("c") == r + 1
    error = refusal(run, "c", 3, "h3")
    assert error.code == "left_out" and error.reply.action == "rejoin"
    run.clock.now += 1e6
    assert refusal(run, "c", 3, "h3").code == "left_out"
    (shown,) = run.book.public().left_out
    assert shown.seconds_left is None
    run.book.registered("c")
    assert run.book.consecutive_exclusions("c") == 0
    tc = run.ask("c", 3, "", has_state=False)
    ta, tb = run.ask("a", 3, "h3"), run.ask("b", 3, "h3")
    assert reply(tc)["resync"] == [2] and reply(ta)["members"] == ["a", "b", "c"]
    assert tb.done


def test_exclusions_not_in_a_row_do_not_add_up() -> None:
    run = Run("a", "b")
    for r in range(5):
        qid = formed(run, "a", "b", round_=r)
        for w in "ab":
            ok(run, w, qid, r + 1, f"h{r + 1}", excluded=("b",) if r % 2 == 0 else ())
    assert run.book.consecutive_exclusions("b") == 1 and run.book.public().left_out == ()


def test_a_member_dead_after_the_commit_point_is_not_waited_for_past_the_suspect_window() -> None:
    """a and b report ok; c died between its commit point and its report: once it has been
    silent for two heartbeat intervals plus the margin since the first report, the quorum
    completes with a and b's state, and their next quorum forms without c."""
    beats = Beats(interval=1.0)
    run = Run("a", "b", "c", heartbeat_of=beats)
    beats.clock = run.clock
    qid = formed(run, "a", "b", "c")
    for w in "abc":
        beats.beat(w)
    run.clock.now += 0.1
    ok(run, "a", qid, 1, "h1")
    ok(run, "b", qid, 1, "h1")
    ta, tb = run.ask("a", 1, "h1"), run.ask("b", 1, "h1")
    run.clock.now += 2.4  # within two intervals and the margin
    run.book.tick()
    assert run.book.open is not None and run.book.open.id == qid and not ta.done
    run.clock.now += 0.1
    run.book.tick()
    assert run.book.rounds_completed == 1 and run.book.round == 1
    assert reply(ta)["members"] == reply(tb)["members"] == ["a", "b"]
    assert (reply(ta)["round"], reply(ta)["hash"]) == (1, "h1")


def test_a_member_heartbeating_after_the_others_reported_is_waited_for() -> None:
    beats = Beats(interval=1.0)
    run = Run("a", "b", "c", heartbeat_of=beats)
    beats.clock = run.clock
    qid = formed(run, "a", "b", "c")
    ok(run, "a", qid, 1, "h1")
    ok(run, "b", qid, 1, "h1")
    for _ in range(20):  # alive (heartbeats): its report is only slow
        run.clock.now += 1.0
        beats.beat("c")
        run.book.tick()
    assert run.book.open is not None and run.book.rounds_completed == 0
    run.clock.now += 2.4  # then silent, within two intervals and the margin
    run.book.tick()
    assert run.book.open is not None
    ok(run, "c", qid, 1, "h1")
    assert run.book.rounds_completed == 1
