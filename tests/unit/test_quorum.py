"""All-reduce mode's quorums (server/allreduce/quorum_book.py) with a fake clock: when a quorum
forms, where it starts (round, hash, source, resync), how outcomes complete or discard it, and the
errors."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from diloco.server.allreduce.quorum_book import QuorumBook, Ticket
from diloco.server.allreduce.quorum_records import Choice, choose
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
    assert q["quorum_id"] == "i0-2" and (q["round"], q["source"], q["resync"]) == (1, 0, [1])


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
    assert reply(run.ask("a", 0, "h"))["save"] is False  # round 0 -> 1
    run.book.open = None
    assert reply(run.ask("a", 1, "h"))["save"] is True  # round 1 -> 2
    run.book.open = None
    assert run.book.request_save().to_json() == {"status": "requested", "round": 1}
    qid = str(reply(run.ask("a", 2, "h"))["quorum_id"])
    run.report("a", qid, ok=False)
    assert reply(run.ask("a", 2, "h"))["save"] is True


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
    """b's commit point failed after a's passed: a reports its new state to the quorum already
    discarded by b's failure; the next quorum starts from a's state and names that quorum, so b
    knows its own contribution is in it."""
    run = Run("a", "b")
    qid = formed(run, "a", "b")
    run.report("b", qid, ok=False)
    assert run.report("a", qid, round_=1, hash_="h1")["status"] == "discarded"
    ta, tb = run.ask("a", 1, "h1"), run.ask("b", 0, "h0")
    assert reply(tb)["made_by"] == reply(ta)["made_by"] == qid
    assert reply(tb)["resync"] == [1]
    # A start no member reported making (a fresh run's) names none.
    fresh = Run("a")
    assert reply(fresh.ask("a"))["made_by"] == ""
