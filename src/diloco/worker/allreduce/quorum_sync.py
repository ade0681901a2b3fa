"""All-reduce mode on the worker (``diloco server --allreduce``; docs/design/allreduce.md): the
workers average their pseudo-gradients among themselves and each applies the same
outer step; the server only forms a quorum per round and records its outcome.

The worker holds the run's shared state (``SharedState``: the snapshot and the outer
optimizer's momentum) beside its payload's averaging buffers. One quorum round (``_round``):

1. ``POST /quorum`` with the round and hash of the state held; the reply (an ``Assignment``,
   ``diloco.wire.messages``) names the members, this worker's rank, the state round and hash
   the quorum agrees on, a member holding them (``source``) and the members that must take
   them first (``resync``).
2. A process group of that quorum alone (``QuorumCollective``); if any member must resync, the
   source broadcasts the state. A resyncing worker keeps its local progress on top of the new
   state (a rebase) and checks the hash before anything else.
3. The payload's pseudo-gradient (``snapshot - local``: the whole model, or one fragment) and
   the quorum's checked weighted average of it (``checked_average``): a member whose
   pseudo-gradient is not finite, whose norm is far above the quorum's median or whose weight
   is out of bounds is left out (it contributes nothing, then takes the agreed state:
   ``Payload.left_out``), and the average is checked against the members' stated norms.
4. The commit point: a hash of a sample of the average, compared across the quorum in one tiny
   collective (its maximum and minimum) that also carries each member's veto (its check of the
   average failed: the round is discarded on every member). Only then the payload's outer step
   on the state, and the new state's hash reported to the server (with the members left out),
   which compares the members' hashes (the majority's state is the run's).

A failure before the commit point (a member died, a timeout) raises ``QuorumFailed``: the
snapshot and the model are as they were, the failure is reported, and the next quorum repeats
the round with a freshly computed pseudo-gradient. The commit collective itself may succeed on
some members and fail on others (two generals): those that passed apply the round, the others
remember the quorum, and when a later quorum hands them the state that quorum made (the server
names it, ``made_by``), they take it without keeping their already counted progress on top
(``Payload.settle_counted``). A quorum whose weights are all 0 (a start: every worker joins by
one such round, receiving the state if its own differs) takes no step.

What a round averages and when one is due is the payload's (``allreduce/payload.py``); this
loop is the same for both. The server's refusals (a state not agreed, a worker left out) set
this worker's ``Standing`` (``allreduce/standing.py``); the members the checks left out are
named by ``average_checks.name_excluded``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from diloco.core import rebase_, to_progress_
from diloco.wire.messages import Assignment, Pending, Registered, quorum_reply
from diloco.worker.allreduce.average_checks import checked_average, name_excluded
from diloco.worker.allreduce.collective import (
    QuorumCollective,
    QuorumFailed,
    compare,
    state_hash,
)
from diloco.worker.allreduce.http_store import HttpMeeting
from diloco.worker.allreduce.payload import Payload
from diloco.worker.allreduce.quantized import QUANTIZED, Residuals, count_bytes
from diloco.worker.allreduce.shared_state import SharedState
from diloco.worker.allreduce.standing import Standing
from diloco.worker.session import Session
from diloco.worker.state.start_state import StartState
from diloco.worker.transport.client import SYNC_FAILURES, Conflict, UnknownWorker

log = logging.getLogger(__name__)

SAMPLE = 1009
"""The commit point hashes every SAMPLE-th element of the average (a prime: no stride of a
parameter's shape lines up with it)."""

COMM_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
"""What a quorum's all-reduce carries (``Assignment.comm``) when not quantized (``QUANTIZED``)."""

MAX_QUORUM_TRIES = 5
"""Quorums tried in one sync before training goes on locally (each failed one is discarded)."""


class QuorumSync:
    """The ``SyncStrategy`` of a server in all-reduce mode: the quorum loop over ``payload``."""

    def __init__(self, session: Session, state: SharedState, payload: Payload) -> None:
        self._s = session
        self._state = state
        self._payload = payload
        self._hash = state.hash()
        # The model holds progress over a snapshot that is being replaced (a broadcast to this
        # worker broke off): it presents no state and syncs until it receives one.
        self._needs_state = False
        self._standing = Standing(session)  # what the server's refusals told this worker
        # A quorum whose commit point failed here after this worker's pseudo-gradient was in
        # its complete average, and the total steps then: the others may have applied it.
        self._uncertain: tuple[str, int] | None = None
        self._leaving = threading.Event()  # no more quorums once set
        # The members left out of the round in progress (worker ids), for its report.
        self._excluded: tuple[str, ...] = ()
        # Quantized quorums' error feedback (``quantized.Residuals``), none if error_feedback off.
        self.residuals = Residuals.resumed(session, session.settings.error_feedback)
        self._s.base_round = 0

    # --- SyncStrategy -------------------------------------------------------------------------

    @property
    def last_submission(self) -> str | None:
        return None  # nothing is held by the server

    @property
    def round(self) -> int:
        return self._s.base_round

    def held(self) -> tuple[int, str] | None:
        """The run's state this worker holds, as its quorum requests present it: the round
        and the hash of its snapshot and momentum (``SharedState.hash``), hashed now, so a
        state changed since its last round is not vouched for by that round's hash; None
        while it holds none it can vouch for (it awaits the run's). Between rounds only: a
        round in flight changes the state under the hash."""
        if self._needs_state or self._standing.disowned:
            return None
        return self._s.base_round, self._state.hash()

    def start_from(self, start: StartState) -> None:
        """Before the join: hold ``start`` (a checkpoint's round, snapshot and momentum) as
        the run's state, the model taking its parameters, so the join presents it as a member
        that lived through that round would (``start_state.py``)."""
        self._state.start_from(start)
        self._s.local.adopt_all()
        self._s.base_round = start.round
        self._hash = self._state.hash()

    def join(self, reply: Registered) -> None:
        """The start: one quorum round without a contribution, so this worker trains from the
        run's state (received from a member when its own differs). Waits for the quorum; a
        server that forgot this worker meanwhile (it restarted, or evicted it) is registered
        with again, and the wait goes on."""
        s = self._s
        while True:
            try:
                self._standing.rejoin_if_forgotten()
                if self._one_sync(weighted=False) == "done":
                    return
            except UnknownWorker:
                s.need_rejoin.set()
            except Conflict as exc:
                if exc.code == "left_out":  # the others go on without it: it trains alone
                    self._standing.left_out(exc)
                    return
                log.warning("worker %s: waiting to join a quorum: %s", s.worker_id, exc)
            except SYNC_FAILURES as exc:
                log.warning("worker %s: waiting to join a quorum: %s", s.worker_id, exc)

    def rejoin(self, reply: Registered) -> str:
        return "kept locally (the workers hold the state in all-reduce mode)"

    def after_step(self) -> None:
        self._payload.after_step(self)

    def sync_now(self) -> None:
        self._payload.sync_now(self)

    def finish(self, *, submit: bool) -> None:
        """Let the round in flight end; nothing is handed in after that (only a quorum
        averages)."""
        self._leaving.set()
        self._payload.leave()
        if submit and self._s.local_step > 0:
            log.info(
                "worker %s leaves with %d local steps not averaged (all-reduce mode averages "
                "only among the workers of a quorum)",
                self._s.worker_id,
                self._s.local_step,
            )

    # --- Rounds (payload.py) --------------------------------------------------------------------

    def sync(self) -> None:
        """Average with a quorum, blocking the training loop (``attempts``)."""
        s = self._s
        t0 = time.monotonic()
        s.syncing = True
        try:
            self.attempts()
        finally:
            s.syncing = False
            s.metrics["sync_time_s"] += time.monotonic() - t0

    def attempts(self) -> bool:
        """Quorums until one completes: True then. Never raises a network error: when no
        quorum completes (``MAX_QUORUM_TRIES`` discarded, the wait for one past
        ``max_barrier_wait``, the server unreachable) False, and training goes on locally; the
        next sync tries again with the progress made until then. Only a worker left without
        state keeps trying until it gets one. A worker left out of quorums (409 ``left_out``)
        returns False at once and asks again at its next sync."""
        s = self._s
        wait = s.settings.max_barrier_wait
        deadline = time.monotonic() + wait if wait else None
        discarded = 0
        while True:
            try:
                self._standing.rejoin_if_forgotten()
                outcome = self._one_sync(weighted=not self._standing.restarting)
            except UnknownWorker:
                s.need_rejoin.set()
                continue
            except Conflict as exc:
                s.metrics["failed_syncs"] += 1
                if exc.code == "left_out":
                    self._standing.left_out(exc)
                else:
                    log.warning("worker %s: sync failed: %s", s.worker_id, exc)
                return False
            except SYNC_FAILURES as exc:
                s.metrics["failed_syncs"] += 1
                log.warning("worker %s: sync failed: %s", s.worker_id, exc)
                if self._needs_state:
                    continue  # the client's retries already waited between attempts
                return False
            if outcome == "done":
                s.metrics["rounds"] += 1
                self._payload.completed()
                self._standing.completed()
                return True
            if outcome == "refused":
                continue  # it asks again at once, presenting no state
            discarded += outcome == "discarded"
            late = deadline is not None and time.monotonic() > deadline
            if (discarded >= MAX_QUORUM_TRIES or late or self._leaving.is_set()) and (
                not self._needs_state
            ):
                s.metrics["failed_syncs"] += 1
                log.warning(
                    "worker %s: no quorum completed (%d discarded); training goes on",
                    s.worker_id,
                    discarded,
                )
                return False

    # --- one round ------------------------------------------------------------------------------

    def _one_sync(self, *, weighted: bool) -> str:
        """Ask for a quorum and run its round: ``"done"``, ``"pending"`` (the long poll ended
        first), ``"discarded"`` (a member failed: counted, reported, nothing changed here) or
        ``"refused"`` (the server refused the state presented: the next ask presents none)."""
        s = self._s
        assert s.worker_id is not None
        unsure = self._needs_state or self._standing.disowned
        try:
            reply = s.client.quorum(
                s.worker_id,
                round=s.base_round,
                hash="" if unsure else self._hash,
                weight=self._payload.weight_now(weighted),
            )
        except Conflict as exc:
            if not self._standing.refused(exc, presented=not unsure):
                raise
            return "refused"
        q = quorum_reply(reply)
        if isinstance(q, Pending):
            return "pending"
        self._excluded = ()
        try:
            new_round, new_hash = self._round(q, weighted)
        except QuorumFailed as exc:
            s.metrics["discarded_rounds"] += 1
            log.warning("worker %s: round discarded (%s): %s", s.worker_id, exc.stage, exc)
            self._report(q, ok=False, error=str(exc), stage=exc.stage, excluded=self._excluded)
            return "discarded"
        self._report(q, ok=True, round=new_round, hash=new_hash, excluded=self._excluded)
        return "done"

    def _round(self, q: Assignment, weighted: bool) -> tuple[int, str]:
        s, payload = self._s, self._payload
        try:
            meeting = HttpMeeting(s.client, s.worker_id or "", q.rendezvous)
            with _stage("join"):
                quorum = QuorumCollective.build(meeting, q.quorum_id, q.rank, q.size, q.timeout)
            with quorum:
                try:
                    with _stage("join"):
                        self._state.meet(quorum, s.worker_id or "", q.rendezvous.path)
                    if q.resync:
                        with _stage("resync"):
                            self._share_state(quorum, q)
                    with _stage("average"):
                        tensors, weight = payload.contribution(q, weighted)
                    total, left_out = self._average(quorum, q, tensors, weight)
                finally:
                    self._state.part()
            # The collective is closed. Every member applies the same step to the same state,
            # so the new hashes agree; the server compares them, and a member whose hash is not
            # the majority's is sent the state at its next quorum.
            if total > 0:
                self.residuals.commit()  # passed the commit point and steps: owed from now on
                payload.step(q)
                s.base_round = q.round + 1
            if left_out:
                payload.left_out(q)
            new_hash = self._hash = self._state.hash()
            if q.save and q.rank == 0:
                self._state.save(q.quorum_id, *payload.checkpoint_state())
            return s.base_round, new_hash
        finally:
            payload.round_ended(has_state=not self._needs_state)

    def _average(
        self, quorum: QuorumCollective, q: Assignment, tensors: list[torch.Tensor], weight: float
    ) -> tuple[float, bool]:
        """The quorum's checked average of ``tensors`` in place (``checked_average``), agreed at
        the commit point: the admitted weights' sum, and whether this worker was left out."""
        comm = COMM_DTYPES.get(q.comm, torch.float32)
        self.residuals.discard()  # a dense round neither sends nor moves the residuals
        with _stage("average"):
            if self._state.streamed:  # a sharded group's: the tensors are on its shards
                if q.comm in QUANTIZED:  # refused at its join (worker/choose.py)
                    raise QuorumFailed(q.quorum_id, f"a sharded group cannot average {q.comm}")
                averaged, sample, numel = self._state.streamed_average(quorum, weight, comm, SAMPLE)
            else:
                # One residual per share of the model: a streaming fragment is the round's.
                share = q.round % self._s.settings.num_fragments
                quantized = self.residuals.for_round(q.comm, share, tensors, self._s.encoder.decay)
                averaged = checked_average(
                    quorum,
                    tensors,
                    weight,
                    comm,
                    norm_bound=self._state.rules.norm_bound,
                    quantized=quantized,
                )
                sample = [t.reshape(-1)[::SAMPLE] for t in tensors]
                numel = sum(t.numel() for t in tensors)
        self._excluded, left_out = name_excluded(self._s.worker_id, q, averaged)
        if left_out:
            self._s.metrics["excluded_rounds"] += 1
        count_bytes(self._s.metrics, quorum.size, averaged.total, averaged.moved, numel, comm)
        # The commit point: this tiny collective succeeds only once every member holds the
        # complete average; nothing has changed anywhere before it. It compares a sample of the
        # average (every SAMPLE-th element): a full CRC would cost 0.1 s per 100M parameters,
        # and the full hash of the new state is compared by the server.
        # A member whose check of the average failed vetoes in the same collective, so the
        # round is discarded on every member that completes it, never on some.
        if not averaged.sound:
            log.error(
                "worker %s: quorum %s's average fails its check (norm %.6g, the members' stated "
                "norms allow %.6g, or not finite): the round is discarded",
                self._s.worker_id,
                q.quorum_id,
                averaged.norm,
                averaged.verdict.bound,
            )
        try:
            same, vetoed = compare(quorum, state_hash(sample), veto=not averaged.sound)
        except QuorumFailed as exc:
            exc.stage = exc.stage or "commit"
            if weight > 0 and not left_out:  # the others may have applied this worker's part
                self._uncertain = (q.quorum_id, self._s.total_steps)
            raise
        self._uncertain = None  # the last quorum settled it either way
        if vetoed:
            raise QuorumFailed(
                q.quorum_id,
                "the average failed its check on a member (not finite, or its norm above what "
                "the members' stated norms allow: a member sent another tensor than it stated)",
                stage="check",
            )
        if not same:
            raise QuorumFailed(q.quorum_id, "the members' averages differ", stage="commit")
        return averaged.total, left_out

    def _share_state(self, quorum: QuorumCollective, q: Assignment) -> None:
        """The source's state to every member (those that hold it receive the same bytes); a
        member that needed it keeps its local progress on top (a rebase) once the agreed hash
        checks. A receiver whose broadcast broke off holds only its progress: it presents no
        state and trains no more until a later quorum hands it the state."""
        s, local = self._s, self._s.local
        if q.receiving:
            self._payload.receiving_state(q)
            if not self._needs_state:
                local.each_param(to_progress_)
                self._needs_state = True  # the model holds progress; the snapshot is about to go
        self._state.broadcast(quorum, q.source)
        if not q.receiving:
            return
        got = self._state.hash()
        if got != q.hash:
            raise QuorumFailed(q.quorum_id, f"state received has hash {got}, expected {q.hash}")
        uncertain, self._uncertain = self._uncertain, None
        if self._standing.restarting:
            self._payload.take_state()  # its progress, excluded too often, is dropped
            self.residuals.forget()
        elif uncertain is not None and uncertain[0] == q.made_by:
            # The state received was made by the quorum whose commit point failed here: this
            # worker's pseudo-gradient is in it, so its progress up to then must not count
            # again (rebasing it would).
            self._payload.settle_counted(q, uncertain[1])
            self.residuals.forget()
        else:
            local.each_param(rebase_)
        self._needs_state = False
        self._standing.received()
        s.base_round = q.round
        self._hash = got
        s.metrics["rebases"] += 1

    def _report(self, q: Assignment, **outcome: Any) -> None:
        """Tell the server how the round ended here (``QuorumOutcome``)."""
        s = self._s
        assert s.worker_id is not None
        try:
            s.client.quorum_outcome(s.worker_id, q.quorum_id, **outcome)
        except SYNC_FAILURES as exc:  # the server learns it from the next quorum's hashes
            log.warning("worker %s: could not report round %s: %s", s.worker_id, q.quorum_id, exc)


@contextmanager
def _stage(stage: str) -> Iterator[None]:
    """A ``QuorumFailed`` raised inside says it broke off at ``stage``, unless it says already
    (``QuorumOutcome.stage``)."""
    try:
        yield
    except QuorumFailed as exc:
        exc.stage = exc.stage or stage
        raise
