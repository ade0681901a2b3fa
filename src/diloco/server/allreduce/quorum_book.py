"""All-reduce mode's control plane: forming one quorum of workers per round, and recording how
each quorum ended. Pure state on the server's event loop (no HTTP, no tensors); the clock is
injected, so tests drive it with a fake one.

The book owns when a quorum forms and how it ends. It keeps, and consults: the requests waiting
(``waiting.py``), the quorum records (``quorum_records.py``: where a quorum starts, the open one,
the ended ones), the states the run agreed on (``agreement.py``), the silent members of failed
quorums (``suspects.py``), the workers left out although they ask (``leaves.py``) and the checks'
exclusion counts (``exclusions.py``).

Contract (the routes, ``POST /quorum`` and ``POST /quorum/outcome``: docs/design/allreduce.md,
"Protocol detail"):

- ``ask`` files a worker's request. A quorum forms when no quorum is open, every live
  registered worker has a request waiting, at least one of them holds state, and there are at
  least ``min_workers`` of them (``num_workers`` for the first quorum of a fresh run, as round 0
  waits for them in server mode; also for the first quorum of a server started into a run under
  way, a member holding a round above 0, until ``resume_grace`` has passed since the start, so
  that the workers come back before any goes on alone). When some live workers are not asking,
  the quorum forms with those that are once ``join_timeout`` has passed since the earliest
  request (counted from the last quorum's end at the soonest; 0: never). Members of a discarded
  quorum that stay silent (no report, request or heartbeat) for two of their heartbeat
  intervals are not waited for (``suspects.py``).
- ``ask`` refuses (409, nothing changes) a worker left out for now (``left_out``: blamed for
  two quorums in a row failed at a join or collective, or excluded by the checks
  ``EXCLUSIONS_LEFT_OUT`` rounds in a row: ``leaves.LeftOut``), and a state above round 0
  the run never agreed on that no member reported making (``unagreed_state``:
  ``agreement.Agreement.refuse_unagreed``).
- Ranks follow the worker ids' order. The quorum starts from the highest round any member holds
  among the states the run agreed on (``agreement.Agreement``; a server without records takes
  its first quorum's majority, ``agreement.learn``), at the hash most members hold at that
  round (the last agreed hash when a member holds it; otherwise ties go to the lowest rank).
  ``source`` is the lowest rank holding it; ``resync`` the ranks that must receive it (no
  state, an older round, another hash, a state not agreed).
- The quorum completes when every member reported ok, or when those that did not went silent
  (the suspects' rule) after the others all reported ok: the state most members report (round
  and hash) becomes the agreed one and the server's round; a round that advanced counts in
  ``rounds_completed``. A member reporting a failure, a member leaving (deregistered, evicted)
  before reporting, a member asking again before reporting (it failed and retries) or the
  deadline (``3 * collective_timeout + poll_margin`` after forming) discards it: the workers
  keep their pseudo-gradients and ask again.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable

from diloco.server.allreduce.agreement import Agreement
from diloco.server.allreduce.exclusions import Exclusions
from diloco.server.allreduce.leaves import BLAMED_STAGES, LeftOut
from diloco.server.allreduce.quorum_records import Ended, Finished, QuorumRecord, choose, failure
from diloco.server.allreduce.suspects import HeartbeatOf, Suspects
from diloco.server.allreduce.waiting import Ticket, Waiting
from diloco.server.errors import left_out, unknown_worker
from diloco.server.observe.records import QuorumStatus, QuorumSummary
from diloco.wire.messages import (
    Assignment,
    OutcomeRecorded,
    QuorumAsk,
    QuorumOutcome,
    Rendezvous,
    SaveRequested,
)

log = logging.getLogger(__name__)


def resume_grace(heartbeat_timeout: float, collective_timeout: float) -> float:
    """How long a server started into a run under way holds its first quorum for the members
    to come back: as the server mode holds a resumed round (the heartbeat timeout), and at
    least as long as a member of the quorum open when the server died may be held by its join
    (twice the collective timeout plus a second, worker/allreduce/connect.py); else the first
    worker back goes on alone and its rounds are lost when a majority returns with an older
    state (seen under chaos, issue 26)."""
    return max(heartbeat_timeout, 2 * collective_timeout + 1.0)


class QuorumBook:
    """The quorums of one server life (``instance``). ``live()``: the registered workers."""

    def __init__(
        self,
        *,
        instance: str,
        live: Callable[[], set[str]],
        clock: Callable[[], float],
        min_workers: int = 1,
        num_workers: int = 1,
        join_timeout: float = 15.0,
        collective_timeout: float = 30.0,
        poll_margin: float = 30.0,
        save_every: int = 0,
        rendezvous: Rendezvous | None = None,
        resume_grace: float = 0.0,
        heartbeat_of: HeartbeatOf | None = None,
        left_out_base: float | None = None,
    ) -> None:
        self.instance = instance
        self._live = live
        self._clock = clock
        self.min_workers = min_workers
        self.num_workers = num_workers  # the first quorum's; an operator may change it
        self.join_timeout = join_timeout
        self.collective_timeout = collective_timeout
        self.poll_margin = poll_margin
        self.save_every = save_every
        self.rendezvous = rendezvous  # where server/allreduce/rendezvous.py is served
        #: Called with a quorum id once no member can still be reading its rendezvous keys.
        self.forget: Callable[[str], object] | None = None
        self.round = 0  # of the state the last quorum started from or completed with
        self.rounds_completed = 0
        self.rounds_discarded = 0
        self.open: QuorumRecord | None = None
        self._waiting = Waiting(clock)
        self._closed_at = -float("inf")
        self._formed = 0
        self._agreement = Agreement()  # the states a quorum may start from
        self._finished = Finished()
        self._save_requested = False
        # A server (re)started into a run under way knows none of its workers until they come
        # back: for this long after the start its first quorum waits for num_workers of them,
        # so the first to re-register does not go on alone with the run's only copy.
        self._resume_until = clock() + resume_grace
        # Members of a failed quorum gone silent: the next quorum does not wait for their
        # eviction (server/allreduce/suspects.py).
        self._suspects = Suspects(heartbeat_of or (lambda worker: None))
        # Workers left out although they ask: blamed for failed joins, or excluded too often.
        self._left_out = LeftOut(2 * collective_timeout if left_out_base is None else left_out_base)
        # Members the quorums' checks left out (``note_excluded``).
        self._exclusions = Exclusions()

    # --- requests -----------------------------------------------------------------------------

    def ask(self, ask: QuorumAsk) -> Ticket:
        """File a request (410 for a worker not registered). A member of the open quorum that
        has not reported asks again only after failing: that quorum is discarded."""
        worker = ask.worker_id
        if worker not in self._live():
            raise unknown_worker(worker)
        self._refuse(ask)
        q = self.open
        if q is not None and worker in q.members and worker not in q.outcomes:
            self._discard(q, f"member {worker} asked for a new quorum before reporting", blame=True)
            self._refuse(ask)  # it may be the member that failure left out
        self._suspects.heard(worker)
        ticket = self._waiting.file(ask)
        self.tick()
        return ticket

    async def wait(self, ticket: Ticket, timeout: float) -> Assignment | None:
        """The ticket's quorum reply, or None when none formed within ``timeout`` (the worker
        asks again); 410 when the worker left meanwhile (``Waiting.wait``)."""
        return await self._waiting.wait(ticket, timeout)

    def _refuse(self, ask: QuorumAsk) -> None:
        """409 ``left_out`` for a worker the quorums do without for now; 409
        ``unagreed_state`` for a state presented that the run never agreed on
        (``Agreement.refuse_unagreed``). Changes nothing."""
        worker, now = ask.worker_id, self._clock()
        leave = self._left_out.of(worker, now)
        if leave is not None:
            raise left_out(worker, leave.reason, leave.until - now, leave.rejoin)
        self._agreement.refuse_unagreed(ask)

    def refuse_unheld(self, worker_id: str, state: tuple[int, str] | None) -> None:
        """Swarm mode: a replica of this book's stage may enter the route table only holding a
        state the stage agreed on (``Agreement.refuse_unheld``). Changes nothing."""
        self._agreement.refuse_unheld(worker_id, state)

    def pending(self) -> tuple[str, ...]:
        return self._waiting.workers()

    # --- forming ------------------------------------------------------------------------------

    def tick(self) -> None:
        """Discard an open quorum past its deadline, then form one if the rules allow. Called
        after every change and periodically (``tick_loop``)."""
        now = self._clock()
        q = self.open
        if q is not None and now >= q.deadline:
            missing = ", ".join(q.missing())
            self._discard(q, f"no outcome from {missing} by its deadline", blame=True)
        elif q is not None and q.first_report is not None:
            if self._suspects.gone_after_reports(q, now):
                self._complete(q)  # the silent died after the commit point
        if self.open is None and self._waiting:
            self._try_form(now)

    async def tick_loop(self) -> None:
        steps = [self.collective_timeout, self.join_timeout or self.collective_timeout]
        # Often enough that a deadline, a join timeout or a silent member's grace
        # (server/allreduce/suspects.py) is acted on within a quarter second; each tick is a dict
        # scan.
        interval = max(0.05, min(0.25, *(s / 4 for s in steps)))
        while True:
            await asyncio.sleep(interval)
            self.tick()

    def _try_form(self, now: float) -> None:
        silent = self._suspects.silent(now)
        out = self._left_out.current(now)
        live = self._live() - silent - set(out)
        waiting = [w for w in self._waiting.workers() if w in live]
        asks = [self._waiting.ask_of(w) for w in waiting]
        fresh = self._formed == 0 and all(a.round == 0 for a in asks)
        resuming = self._formed == 0 and not fresh and now < self._resume_until
        needed = max(self.num_workers, self.min_workers) if fresh or resuming else self.min_workers
        if len(waiting) < needed:
            return
        sources = self._agreement.sources(asks)
        if not sources.held:
            if set(waiting) == live:
                self._agreement.unheld()
            return
        if not sources.current:
            if set(waiting) != live:
                return  # a live worker not asking yet may hold the run's state: wait for it
            self._agreement.lost()
        if set(waiting) != live:
            start = max(self._waiting.since(waiting), self._closed_at)
            if self.join_timeout <= 0 or now < start + self.join_timeout:
                return
        if silent:
            log.warning(
                "quorum forms without %s: silent since their last quorum failed (not evicted; "
                "they count again once heard from)",
                ", ".join(sorted(silent)),
            )
        self._agreement.adopt(sources, asks, waiting)
        self._form(tuple(waiting), asks, now, sources.acceptable)

    def _form(
        self,
        members: tuple[str, ...],
        asks: list[QuorumAsk],
        now: float,
        acceptable: Callable[[int, str], bool],
    ) -> None:
        start = choose(asks, self._agreement.latest, acceptable)
        self._formed += 1
        every = self.save_every > 0 and (start.round + 1) % self.save_every == 0
        q = QuorumRecord(
            id=f"{self.instance}-{self._formed}",
            members=members,
            start=start,
            save=self._save_requested or every,
            save_requested=self._save_requested,
            deadline=now + 3 * self.collective_timeout + self.poll_margin,
        )
        self._save_requested = False
        self.open = q
        self.round = start.round
        meet, made_by = self.meeting_point(), self._agreement.made_by((start.round, start.hash))
        for rank, worker in enumerate(members):
            self._waiting.place(worker, q.assignment(rank, meet, self.collective_timeout, made_by))
        log.info(
            "quorum %s formed: %s at round %d (source rank %d, resync %s)",
            q.id,
            ", ".join(members),
            start.round,
            start.source,
            list(start.resync),
        )

    # --- outcomes -----------------------------------------------------------------------------

    def report(self, outcome: QuorumOutcome) -> OutcomeRecorded:
        """Record one member's outcome: 410 for a worker not registered, 404 ``unknown_quorum``
        for an id this server never formed (it restarted: ask for a new quorum), 409
        ``not_a_member``. A quorum that already ended answers how it ended."""
        worker, qid = outcome.worker_id, outcome.quorum_id
        if worker not in self._live():
            raise unknown_worker(worker)
        self._suspects.heard(worker)
        q = self.open
        if q is None or q.id != qid:
            ended = self._finished.of(outcome)
            self._agreement.reported_late(outcome, ended)
            return OutcomeRecorded(
                status=ended.status, quorum_id=qid, round=self.round, detail=ended.reason or None
            )
        q.check(outcome)
        if outcome.excluded:
            self.note_excluded(q.id, q.members, outcome.excluded)
        if worker not in q.outcomes:  # a retried report: the first one stands
            q.outcomes[worker] = outcome
            if q.first_report is None:
                q.first_report = self._clock()
            self._agreement.note_made(outcome, q.start.round)
            if not outcome.ok:
                self._discard(q, failure(outcome), blame=outcome.stage in BLAMED_STAGES)
            elif len(q.outcomes) == len(q.members):
                self._complete(q)
            self.tick()
        return OutcomeRecorded(status="recorded", quorum_id=qid, round=self.round)

    def _complete(self, q: QuorumRecord) -> None:
        (new_round, new_hash), reported, diverged = q.majority()
        if diverged:
            log.error(
                "quorum %s: %s ended with another state than the majority's (round %d, %s); "
                "they receive the agreed state at their next quorum",
                q.id,
                ", ".join(diverged),
                new_round,
                new_hash,
            )
        self._agreement.add((new_round, new_hash), f"quorum {q.id} completed")
        self.round = new_round
        self._exclusions.completed(q.id, q.members)
        if new_round > q.start.round:
            self.rounds_completed += 1
        log.info("quorum %s completed: round %d, hash %s", q.id, new_round, new_hash)
        self._left_out.completed(reported, self._clock())
        self._end(q, Ended(q.members, "recorded", "", q.start.round))

    def _discard(self, q: QuorumRecord, reason: str, *, blame: bool = False) -> None:
        """``blame``: a join or a collective failed (or a member missed the deadline); two
        such in a row leave one member out (``leaves.LeftOut``)."""
        self.rounds_discarded += 1
        self._save_requested = self._save_requested or q.save_requested
        log.warning("quorum %s (round %d) discarded: %s", q.id, q.start.round, reason)
        now = self._clock()
        self._suspects.failed(q.members, q.outcomes, now)
        ended = Ended(q.members, "discarded", reason, q.start.round, q.made())
        self._end(q, ended)
        self._agreement.made_by_majority(q.id, ended)
        blamed = self._left_out.failed(q.members, now) if blame else None
        if blamed is not None:  # its request waiting hears it at once
            worker, leave = blamed
            refused = left_out(worker, leave.reason, leave.until - now, False)
            self._waiting.drop(worker, refused=refused)

    def _end(self, q: QuorumRecord, ended: Ended) -> None:
        self.open = None
        self._closed_at = self._clock()
        self._finished.add(q.id, ended, self.forget)

    # --- exclusions (worker/allreduce/average_checks.py) ---------------------------------------

    def note_excluded(self, qid: str, members: tuple[str, ...], excluded: tuple[str, ...]) -> None:
        """A member of quorum ``qid`` reports the members its checks left out: counted once per
        quorum (``Exclusions.note``); a worker excluded ``EXCLUSIONS_LEFT_OUT`` rounds in a row
        is left out of quorums until it registers again."""
        for w in self._exclusions.note(qid, members, excluded):
            self._left_out.exclude(w)

    def consecutive_exclusions(self, worker_id: str) -> int:
        """Quorums in a row whose checks left the worker out (0 once a completed quorum admitted
        it, or it registered again)."""
        return self._exclusions.in_a_row(worker_id)

    @property
    def excluded_rounds(self) -> Counter[str]:
        """Rounds whose checks left each worker out, in all."""
        return self._exclusions.rounds

    @property
    def excluded_last(self) -> tuple[str, ...]:
        """The members the last quorum with exclusions left out."""
        return self._exclusions.last

    def registered(self, worker_id: str) -> None:
        """The worker registered (again): its exclusions in a row start again, and a leave
        until then (``EXCLUSIONS_LEFT_OUT`` of them) ends."""
        self._exclusions.registered(worker_id)
        self._left_out.registered(worker_id)

    # --- membership, control, status ----------------------------------------------------------

    def on_leave(self, worker_id: str) -> None:
        """A worker deregistered or was evicted: its waiting request ends (410), and an open
        quorum it had not reported to is discarded."""
        self._waiting.drop(worker_id)
        self._suspects.heard(worker_id)
        q = self.open
        if q is not None and worker_id in q.members and worker_id not in q.outcomes:
            self._discard(q, f"member {worker_id} left or was evicted")
        self.tick()

    def request_save(self) -> SaveRequested:
        """An operator's save: rank 0 of the next quorum writes a checkpoint after its round."""
        self._save_requested = True
        return SaveRequested(round=self.round)

    def meeting_point(self) -> Rendezvous:
        """Where quorums meet, as a registration reply names it."""
        assert self.rendezvous is not None, "the rendezvous is not served yet"
        return self.rendezvous

    def members_of(self, quorum_id: str) -> tuple[str, ...] | None:
        """The members of the open quorum or of one that ended and is still remembered (who
        may touch its rendezvous keys); None for a quorum unknown here."""
        if self.open is not None and self.open.id == quorum_id:
            return self.open.members
        ended = self._finished.get(quorum_id)
        return ended.members if ended is not None else None

    def public(self) -> QuorumSummary:
        q, now = self.open, self._clock()
        return QuorumSummary(
            instance=self.instance,
            round=self.round,
            quorum=QuorumStatus(q.id, q.members, q.start.round) if q is not None else None,
            rounds_completed=self.rounds_completed,
            rounds_discarded=self.rounds_discarded,
            pending_quorum=self.pending(),
            left_out=self._left_out.public(now),
            excluded_last=self.excluded_last,
            excluded_rounds=self._exclusions.public(),
        )
