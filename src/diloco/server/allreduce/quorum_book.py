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
- Ranks follow the worker ids' order. The quorum starts from the highest round any member with
  state holds, at the hash most members hold at that round (the last agreed hash when a member
  holds it; otherwise ties go to the lowest rank). ``source`` is the lowest rank holding it;
  ``resync`` the ranks that must receive it (no state, an older round, another hash).
- The quorum completes when every member reported ok: the state most members report (round and
  hash) becomes the agreed one and the server's round; a round that advanced counts in
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

from diloco.server.allreduce.quorum_records import Ended, QuorumRecord, choose
from diloco.server.allreduce.suspects import HeartbeatOf, Suspects
from diloco.server.errors import ApiError, bad_request, conflict, unknown_worker
from diloco.server.observe.records import QuorumStatus, QuorumSummary, WorkerExclusions
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
        self.done = False
        self._event = asyncio.Event()

    def settle(self, reply: Assignment | None = None, *, gone: bool = False) -> None:
        self.reply, self.gone, self.done = reply, gone, True
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
        self._agreed: tuple[int, str] | None = None
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
        self._suspects = Suspects(heartbeat_of or (lambda worker: None))
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
        q = self.open
        if q is not None and worker in q.members and worker not in q.outcomes:
            self._discard(q, f"member {worker} asked for a new quorum before reporting")
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
        return ticket.reply

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
            self._discard(q, f"no outcome from {', '.join(missing)} by its deadline")
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

    def _try_form(self, now: float) -> None:
        silent = self._suspects.silent(now)
        live = self._live() - silent
        waiting = sorted(w for w in self._pending if w in live)
        fresh = self._formed == 0 and all(self._pending[w].ask.round == 0 for w in waiting)
        resuming = self._formed == 0 and not fresh and now < self._resume_until
        needed = max(self.num_workers, self.min_workers) if fresh or resuming else self.min_workers
        if len(waiting) < needed or not any(self._pending[w].ask.holds for w in waiting):
            return
        agreed = self._agreed
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
        self._form(tuple(waiting), now)

    def _form(self, members: tuple[str, ...], now: float) -> None:
        start = choose([self._pending[w].ask for w in members], self._agreed)
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
            self._note_made(outcome, q.start.round)
            if not outcome.ok:
                self._discard(q, f"member {worker} failed: {outcome.error or 'no reason given'}")
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

    @staticmethod
    def _member(worker: str, qid: str, members: tuple[str, ...]) -> None:
        if worker not in members:
            raise conflict("not_a_member", f"worker {worker!r} is not a member of quorum {qid!r}")

    def _complete(self, q: QuorumRecord) -> None:
        results = [(q.outcomes[w].round, q.outcomes[w].hash) for w in q.members]
        counts = Counter(results)
        new_round, new_hash = next(r for r in results if counts[r] == max(counts.values()))
        assert new_round is not None
        diverged = [
            w for w, r in zip(q.members, results, strict=True) if r != (new_round, new_hash)
        ]
        if diverged:
            log.error(
                "quorum %s: %s ended with another state than the majority's (round %d, %s); "
                "they receive the agreed state at their next quorum",
                q.id,
                ", ".join(diverged),
                new_round,
                new_hash,
            )
        self._agreed = (new_round, new_hash)
        self.round = new_round
        for w in q.members:
            if not (self._excluded_counted == q.id and w in self.excluded_last):
                self._excluded_in_a_row.pop(w, None)
        if new_round > q.start.round:
            self.rounds_completed += 1
        log.info("quorum %s completed: round %d, hash %s", q.id, new_round, new_hash)
        self._end(q, Ended(q.members, "recorded", "", q.start.round))

    def _discard(self, q: QuorumRecord, reason: str) -> None:
        self.rounds_discarded += 1
        self._save_requested = self._save_requested or q.save_requested
        log.warning("quorum %s (round %d) discarded: %s", q.id, q.start.round, reason)
        self._suspects.failed(q.members, q.outcomes, self._clock())
        self._end(q, Ended(q.members, "discarded", reason, q.start.round))

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

    def consecutive_exclusions(self, worker_id: str) -> int:
        """Quorums in a row whose checks left the worker out (0 once a completed quorum admitted
        it, or it registered again)."""
        return self._excluded_in_a_row.get(worker_id, 0)

    def registered(self, worker_id: str) -> None:
        """The worker registered (again): its exclusions in a row start again."""
        self._excluded_in_a_row.pop(worker_id, None)

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
        q = self.open
        return QuorumSummary(
            instance=self.instance,
            round=self.round,
            quorum=QuorumStatus(q.id, q.members, q.start.round) if q is not None else None,
            rounds_completed=self.rounds_completed,
            rounds_discarded=self.rounds_discarded,
            pending_quorum=self.pending(),
            excluded_last=self.excluded_last,
            excluded_rounds=tuple(
                WorkerExclusions(w, n, self.consecutive_exclusions(w))
                for w, n in sorted(self.excluded_rounds.items())
            ),
        )
