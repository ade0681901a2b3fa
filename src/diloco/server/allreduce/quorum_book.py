"""All-reduce mode's control plane: forming one quorum of workers per round, and recording how
each quorum ended. Pure state on the server's event loop (no HTTP, no tensors); the clock is
injected, so tests drive it with a fake one.

Contract (the routes, ``POST /quorum`` and ``POST /quorum/outcome``: docs/design/allreduce.md,
"Protocol detail"):

- ``ask`` files a worker's request. A quorum forms when no quorum is open, every live
  registered worker has a request waiting, at least one of them holds state, and there are at
  least ``min_workers`` of them (``num_workers`` for the first quorum of a fresh run, as round 0
  waits for them in server mode; also for the first quorum of a server started into a run under
  way, a member holding a round above 0, until ``resume_grace`` has passed since the start, so
  that the workers come back before any goes on alone). When some live workers are not asking, the quorum forms with
  those that are once ``join_timeout`` has passed since the earliest request (counted from the
  last quorum's end at the soonest; 0: never). Members of a discarded quorum that stay silent
  (no report, request or heartbeat) for two of their heartbeat intervals are not waited for
  (``server/allreduce/suspects.py``).
- ``ask`` refuses (409, nothing changes) a worker left out for now (``left_out``: blamed for
  two quorums in a row failed at a join or collective, or excluded by the checks
  ``EXCLUSIONS_LEFT_OUT`` rounds in a row: ``suspects.LeftOut``), and a state above round 0
  the run never agreed on that no member reported making (``unagreed_state``).
- Ranks follow the worker ids' order. The quorum starts from the highest round any member holds
  among the states the run agreed on (``quorum_records.Agreed``; a server without records takes
  its first quorum's majority, ``quorum_records.learn``), at the hash most members hold at that
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
from collections import Counter, OrderedDict
from collections.abc import Callable

from diloco.server.allreduce.quorum_records import Agreed, Ended, QuorumRecord, choose, learn
from diloco.server.allreduce.suspects import (
    EXCLUSIONS_LEFT_OUT,
    HeartbeatOf,
    LeftOut,
    Suspects,
    quiet,
)
from diloco.server.errors import (
    ApiError,
    bad_request,
    conflict,
    left_out,
    unagreed_state,
    unknown_worker,
)
from diloco.server.observe.records import (
    LeftOutStatus,
    QuorumStatus,
    QuorumSummary,
    WorkerExclusions,
)
from diloco.wire.messages import (
    Assignment,
    OutcomeRecorded,
    QuorumAsk,
    QuorumOutcome,
    Rendezvous,
    SaveRequested,
)

log = logging.getLogger(__name__)

FINISHED_KEPT = 256
"""Ended quorums remembered, so a late or retried outcome gets its answer and not a 404."""
BLAMED_STAGES = ("", "join", "resync", "average", "commit")
"""Where a member's failure counts towards leaving one member out (``suspects.LeftOut``): a
connection or a collective broke. A failed check of the average ("check") is the checks'
business (``QuorumOutcome.excluded``)."""
EXCLUSIONS_KEPT = 4096
"""Workers whose exclusion counts are kept (the oldest forgotten first): a bound on memory
that an authenticated worker inventing ids cannot grow."""


class Ticket:
    """One waiting ``POST /quorum``: settled with the worker's quorum reply, with None (the
    worker asked again: this older request answers "pending"), or as ``gone`` (it left)."""

    def __init__(self, ask: QuorumAsk) -> None:
        self.ask = ask
        self.reply: Assignment | None = None
        self.gone = False
        self.refused: ApiError | None = None  # left out while waiting
        self.done = False
        self._event = asyncio.Event()

    def settle(
        self,
        reply: Assignment | None = None,
        *,
        gone: bool = False,
        refused: ApiError | None = None,
    ) -> None:
        self.reply, self.gone, self.refused, self.done = reply, gone, refused, True
        self._event.set()

    async def wait(self) -> None:
        await self._event.wait()


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
        self._pending: dict[str, Ticket] = {}
        self._since: dict[str, float] = {}  # first request not yet placed, across re-polls
        self._closed_at = -float("inf")
        self._formed = 0
        # Every state the run agreed on: only these may be a quorum's source.
        self._agreed = Agreed()
        self._unheld_logged = False
        self._ended: OrderedDict[str, Ended] = OrderedDict()
        # Which quorum's step made each state members reported: a member whose commit point
        # failed after the others' passed learns from it that its contribution is in the state
        # it receives (worker/allreduce/quorum_sync.py, "the two generals").
        self._made_by: OrderedDict[tuple[int, str], str] = OrderedDict()
        self._save_requested = False
        self._to_forget: list[str] = []
        # A server (re)started into a run under way knows none of its workers until they come
        # back: for this long after the start its first quorum waits for num_workers of them,
        # so the first to re-register does not go on alone with the run's only copy.
        self._resume_until = clock() + resume_grace
        # Members of a failed quorum gone silent: the next quorum does not wait for their
        # eviction (server/allreduce/suspects.py).
        self._heartbeat_of: HeartbeatOf = heartbeat_of or (lambda worker: None)
        self._suspects = Suspects(self._heartbeat_of)
        # Workers left out although they ask: blamed for failed joins, or excluded too often.
        self._left_out = LeftOut(2 * collective_timeout if left_out_base is None else left_out_base)
        # Members the quorums' checks left out (``note_excluded``): rounds per worker, rounds
        # in a row (reset by a completed quorum that admitted it, or a registration), the last
        # quorum's, and the quorum they were counted for (each quorum once).
        self.excluded_rounds: Counter[str] = Counter()
        self._excluded_in_a_row: Counter[str] = Counter()
        self.excluded_last: tuple[str, ...] = ()
        self._excluded_counted: str | None = None

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
        older = self._pending.pop(worker, None)
        if older is not None:
            older.settle(None)
        ticket = self._pending[worker] = Ticket(ask)
        self._since.setdefault(worker, self._clock())
        self.tick()
        return ticket

    async def wait(self, ticket: Ticket, timeout: float) -> Assignment | None:
        """The ticket's quorum reply, or None when none formed within ``timeout`` (the worker
        asks again); 410 when the worker left meanwhile."""
        try:
            await asyncio.wait_for(ticket.wait(), timeout)
        except TimeoutError:
            pass
        finally:
            if not ticket.done and self._pending.get(ticket.ask.worker_id) is ticket:
                del self._pending[ticket.ask.worker_id]
        if ticket.gone:
            raise unknown_worker(ticket.ask.worker_id)
        if ticket.refused is not None:
            raise ticket.refused
        return ticket.reply

    def _refuse(self, ask: QuorumAsk) -> None:
        """409 ``left_out`` for a worker the quorums do without for now; 409
        ``unagreed_state`` for a state presented that the run never agreed on, and no member
        reported making (one reported by a quorum still open, or by a minority of a discarded
        one, is let in: only ``choose``'s ``acceptable`` states are a source, the others receive
        it). A round-0 state is a worker's own start: it receives the run's. Changes nothing."""
        worker, now = ask.worker_id, self._clock()
        leave = self._left_out.of(worker, now)
        if leave is not None:
            raise left_out(worker, leave.reason, leave.until - now, leave.rejoin)
        claim = (ask.round, ask.hash)
        known = claim in self._agreed or claim in self._made_by
        if ask.holds and ask.round > 0 and len(self._agreed) and not known:
            log.warning(
                "worker %s presented a state the run never agreed on (round %d, hash %s; the "
                "last agreed: %s): refused",
                worker,
                ask.round,
                ask.hash,
                self._agreed.latest,
            )
            raise unagreed_state(claim, self._agreed.latest)

    def pending(self) -> tuple[str, ...]:
        return tuple(sorted(self._pending))

    # --- forming ------------------------------------------------------------------------------

    def tick(self) -> None:
        """Discard an open quorum past its deadline, then form one if the rules allow. Called
        after every change and periodically (``tick_loop``)."""
        now = self._clock()
        q = self.open
        if q is not None and now >= q.deadline:
            missing = [w for w in q.members if w not in q.outcomes]
            self._discard(q, f"no outcome from {', '.join(missing)} by its deadline", blame=True)
        elif q is not None and q.first_report is not None:
            self._complete_without_silent(q, now)
        if self.open is None and self._pending:
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

    def _complete_without_silent(self, q: QuorumRecord, now: float) -> None:
        """Members that all reported ok while the others went silent since the first report
        (the suspects' rule: they died after the commit point, before their report): the
        quorum completes with the reports present, and the silent are suspects."""
        assert q.first_report is not None
        missing = [w for w in q.members if w not in q.outcomes]
        if not all(o.ok for o in q.outcomes.values()):
            return
        gone = {w: quiet(self._heartbeat_of, w, q.first_report, now) for w in missing}
        if any(since is None for since in gone.values()):
            return
        log.warning(
            "quorum %s: %s silent since the first report %.2f s ago: completed with the "
            "reports of %s; they are left out of the next quorum until heard from",
            q.id,
            ", ".join(missing),
            now - q.first_report,
            ", ".join(sorted(q.outcomes)),
        )
        for worker, since in gone.items():
            assert since is not None
            self._suspects.failed([worker], (), since)  # silent since then: a suspect now
        self._complete(q)

    def _try_form(self, now: float) -> None:
        silent = self._suspects.silent(now)
        out = self._left_out.current(now)
        live = self._live() - silent - set(out)
        waiting = sorted(w for w in self._pending if w in live)
        fresh = self._formed == 0 and all(self._pending[w].ask.round == 0 for w in waiting)
        resuming = self._formed == 0 and not fresh and now < self._resume_until
        needed = max(self.num_workers, self.min_workers) if fresh or resuming else self.min_workers
        if len(waiting) < needed:
            return
        asks = [self._pending[w].ask for w in waiting]
        # Without records (a fresh run, or a restarted server) the members' majority says what
        # was agreed; then only agreed states can be a source.
        learned = learn(asks) if not len(self._agreed) else None
        acceptable = (
            (lambda r, h: (r, h) == learned) if learned else (lambda r, h: (r, h) in self._agreed)
        )
        if not any(a.holds and acceptable(a.round, a.hash) for a in asks):
            if set(waiting) == live and not self._unheld_logged:
                self._unheld_logged = True
                log.error(
                    "no worker asking holds a state the run agreed on (the last: %s): no quorum "
                    "forms until one does",
                    self._agreed.latest,
                )
            return
        agreed = self._agreed.latest
        current = agreed is None or any(
            (a.round, a.hash) == agreed for a in (self._pending[w].ask for w in waiting) if a.holds
        )
        if not current:
            if set(waiting) != live:
                return  # a live worker not asking yet may hold the run's state: wait for it
            log.warning(
                "no live worker holds the run's state of round %d any more; going on from the "
                "best one held",
                agreed[0] if agreed else 0,
            )
        if set(waiting) != live:
            start = max(min(self._since[w] for w in waiting), self._closed_at)
            if self.join_timeout <= 0 or now < start + self.join_timeout:
                return
        if silent:
            log.warning(
                "quorum forms without %s: silent since their last quorum failed (not evicted; "
                "they count again once heard from)",
                ", ".join(sorted(silent)),
            )
        if learned is not None:
            held = sum((a.round, a.hash) == learned for a in asks)
            self._agreed.add(learned, "learned from the first quorum's members")
            (log.warning if learned[0] > 0 else log.info)(
                "no agreed state recorded (a fresh run, or the server restarted): the run's "
                "state is taken as round %d, hash %s, held by %d of %d members %s",
                learned[0],
                learned[1],
                held,
                len(asks),
                ", ".join(waiting),
            )
        self._unheld_logged = False
        self._form(tuple(waiting), now, acceptable)

    def _form(
        self, members: tuple[str, ...], now: float, acceptable: Callable[[int, str], bool]
    ) -> None:
        start = choose([self._pending[w].ask for w in members], self._agreed.latest, acceptable)
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
        meet = self.meeting_point()
        for rank, worker in enumerate(members):
            self._since.pop(worker, None)
            self._pending.pop(worker).settle(
                Assignment(
                    quorum_id=q.id,
                    rank=rank,
                    size=len(members),
                    members=members,
                    round=start.round,
                    hash=start.hash,
                    source=start.source,
                    resync=start.resync,
                    rendezvous=meet,
                    timeout=self.collective_timeout,
                    save=q.save,
                    made_by=self._made_by.get((start.round, start.hash), ""),
                )
            )
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
            ended = self._ended.get(qid)
            if ended is None:
                raise ApiError(
                    404,
                    "unknown_quorum",
                    f"no quorum {qid!r} here (the server restarted?): ask for a new quorum",
                )
            self._member(worker, qid, ended.members)
            self._note_made(outcome, ended.start_round)  # it applied the step all the same
            if ended.status == "discarded" and outcome.ok and outcome.round is not None:
                ended.made.setdefault(worker, (outcome.round, outcome.hash))
                self._made_by_majority(qid, ended)
            return OutcomeRecorded(
                status=ended.status, quorum_id=qid, round=self.round, detail=ended.reason or None
            )
        self._member(worker, qid, q.members)
        if outcome.ok and outcome.round not in (q.start.round, q.start.round + 1):
            raise bad_request(
                "bad_field",
                f"'round' must be {q.start.round + 1} (the quorum's round + 1), or "
                f"{q.start.round} when no step was taken; got {outcome.round}",
            )
        if outcome.excluded:
            self.note_excluded(q.id, q.members, outcome.excluded)
        if worker not in q.outcomes:  # a retried report: the first one stands
            q.outcomes[worker] = outcome
            if q.first_report is None:
                q.first_report = self._clock()
            self._note_made(outcome, q.start.round)
            if not outcome.ok:
                self._discard(
                    q,
                    f"member {worker} failed"
                    f"{' at ' + outcome.stage if outcome.stage else ''}: "
                    f"{outcome.error or 'no reason given'}",
                    blame=outcome.stage in BLAMED_STAGES,
                )
            elif len(q.outcomes) == len(q.members):
                self._complete(q)
            self.tick()
        return OutcomeRecorded(status="recorded", quorum_id=qid, round=self.round)

    def _note_made(self, outcome: QuorumOutcome, start_round: int) -> None:
        """A member applied its quorum's step: the state it reports was made by that quorum."""
        if outcome.ok and outcome.round == start_round + 1 and outcome.hash:
            self._made_by[(outcome.round, outcome.hash)] = outcome.quorum_id
            while len(self._made_by) > FINISHED_KEPT:
                self._made_by.popitem(last=False)

    def _made_by_majority(self, qid: str, ended: Ended) -> None:
        """The two generals: a state a strict majority of a discarded quorum's members reported
        after its commit point is one the run agreed on (the others receive it)."""
        made = list(ended.made.values())
        for state in set(made):
            if 2 * made.count(state) > len(ended.members) and self._agreed.add(
                state, f"made by a majority of discarded quorum {qid}"
            ):
                log.warning(
                    "quorum %s was discarded, but a majority of its members (%d of %d) applied "
                    "its step: round %d, hash %s is agreed",
                    qid,
                    made.count(state),
                    len(ended.members),
                    *state,
                )

    @staticmethod
    def _member(worker: str, qid: str, members: tuple[str, ...]) -> None:
        if worker not in members:
            raise conflict("not_a_member", f"worker {worker!r} is not a member of quorum {qid!r}")

    def _complete(self, q: QuorumRecord) -> None:
        reported = [w for w in q.members if w in q.outcomes]
        results = [(q.outcomes[w].round, q.outcomes[w].hash) for w in reported]
        counts = Counter(results)
        new_round, new_hash = next(r for r in results if counts[r] == max(counts.values()))
        assert new_round is not None
        diverged = [w for w, r in zip(reported, results, strict=True) if r != (new_round, new_hash)]
        if diverged:
            log.error(
                "quorum %s: %s ended with another state than the majority's (round %d, %s); "
                "they receive the agreed state at their next quorum",
                q.id,
                ", ".join(diverged),
                new_round,
                new_hash,
            )
        self._agreed.add((new_round, new_hash), f"quorum {q.id} completed")
        self.round = new_round
        for w in q.members:
            if not (self._excluded_counted == q.id and w in self.excluded_last):
                self._excluded_in_a_row.pop(w, None)
        if new_round > q.start.round:
            self.rounds_completed += 1
        log.info("quorum %s completed: round %d, hash %s", q.id, new_round, new_hash)
        self._left_out.completed(reported, self._clock())
        self._end(q, Ended(q.members, "recorded", "", q.start.round))

    def _discard(self, q: QuorumRecord, reason: str, *, blame: bool = False) -> None:
        """``blame``: a join or a collective failed (or a member missed the deadline); two
        such in a row leave one member out (``suspects.LeftOut``)."""
        self.rounds_discarded += 1
        self._save_requested = self._save_requested or q.save_requested
        log.warning("quorum %s (round %d) discarded: %s", q.id, q.start.round, reason)
        now = self._clock()
        self._suspects.failed(q.members, q.outcomes, now)
        made = {
            w: (o.round, o.hash)
            for w, o in q.outcomes.items()
            if o.ok and o.round == q.start.round + 1
        }
        ended = Ended(q.members, "discarded", reason, q.start.round, made)
        self._end(q, ended)
        self._made_by_majority(q.id, ended)
        blamed = self._left_out.failed(q.members, now) if blame else None
        if blamed is not None:
            worker, leave = blamed
            log.warning("worker %s left out of quorums: %s", worker, leave.reason)
            ticket = self._pending.pop(worker, None)
            self._since.pop(worker, None)
            if ticket is not None:
                ticket.settle(refused=left_out(worker, leave.reason, leave.until - now, False))

    def _end(self, q: QuorumRecord, ended: Ended) -> None:
        self.open = None
        self._closed_at = self._clock()
        self._ended[q.id] = ended
        while len(self._ended) > FINISHED_KEPT:
            self._ended.popitem(last=False)
        # A discarded quorum's members may still be connecting: its keys go once a later
        # quorum completes (by then each of them has timed out or moved on).
        self._to_forget.append(q.id)
        if ended.status == "recorded" and self.forget is not None:
            for qid in self._to_forget:
                try:
                    self.forget(qid)
                except Exception:  # the store is a cache of connection details, not state
                    log.exception("could not drop the rendezvous keys of quorum %s", qid)
            self._to_forget.clear()

    # --- exclusions (worker/allreduce/average_checks.py) ---------------------------------------

    def note_excluded(self, qid: str, members: tuple[str, ...], excluded: tuple[str, ...]) -> None:
        """A member of quorum ``qid`` reports the members its checks left out: counted once per
        quorum (every member reaches the same verdict), names that are not members ignored."""
        if self._excluded_counted == qid:
            return
        named = tuple(w for w in members if w in excluded)
        if not named:
            return
        self._excluded_counted = qid
        self.excluded_last = named
        for w in named:
            self.excluded_rounds[w] += 1
            self._excluded_in_a_row[w] += 1
        for counts in (self.excluded_rounds, self._excluded_in_a_row):
            while len(counts) > EXCLUSIONS_KEPT:
                del counts[next(iter(counts))]
        log.warning(
            "quorum %s left out %s (a non-finite pseudo-gradient, a norm far above the "
            "quorum's median, or a weight out of bounds; the members' logs say which)",
            qid,
            ", ".join(f"{w} ({self._excluded_in_a_row[w]} in a row)" for w in named),
        )
        for w in named:
            if self._excluded_in_a_row[w] >= EXCLUSIONS_LEFT_OUT:
                leave = self._left_out.exclude(w)
                log.warning("worker %s left out of quorums: %s", w, leave.reason)

    def consecutive_exclusions(self, worker_id: str) -> int:
        """Quorums in a row whose checks left the worker out (0 once a completed quorum admitted
        it, or it registered again)."""
        return self._excluded_in_a_row.get(worker_id, 0)

    def registered(self, worker_id: str) -> None:
        """The worker registered (again): its exclusions in a row start again, and a leave
        until then (``EXCLUSIONS_LEFT_OUT`` of them) ends."""
        self._excluded_in_a_row.pop(worker_id, None)
        self._left_out.registered(worker_id)

    # --- membership, control, status ----------------------------------------------------------

    def on_leave(self, worker_id: str) -> None:
        """A worker deregistered or was evicted: its waiting request ends (410), and an open
        quorum it had not reported to is discarded."""
        ticket = self._pending.pop(worker_id, None)
        if ticket is not None:
            ticket.settle(gone=True)
        self._since.pop(worker_id, None)
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
        ended = self._ended.get(quorum_id)
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
            left_out=tuple(
                LeftOutStatus(w, leave.reason, None if leave.rejoin else leave.until - now)
                for w, leave in sorted(self._left_out.current(now).items())
            ),
            excluded_last=self.excluded_last,
            excluded_rounds=tuple(
                WorkerExclusions(w, n, self.consecutive_exclusions(w))
                for w, n in sorted(self.excluded_rounds.items())
            ),
        )
