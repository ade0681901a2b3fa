"""All-reduce mode on the worker (``diloco server --allreduce``; docs/design.md, "All-reduce
mode"): the workers average their pseudo-gradients among themselves and each applies the same
outer step; the server only forms a quorum per round and records its outcome.

The worker holds the run's shared state: the global parameters (``LocalModel``'s snapshot,
made from its own parameters at start) and the outer optimizer's momentum, both fp32, beside a
buffer for the pseudo-gradient being averaged. One quorum round (``_round``):

1. ``POST /quorum`` with the round and hash of the state held; the reply names the members,
   this worker's rank, the state round and hash the quorum agrees on, a member holding them
   (``source``) and the members that must take them first (``resync``).
2. A process group of that quorum alone (``QuorumGroup``); if any member must resync, the
   source broadcasts the state. A resyncing worker keeps its local progress on top of the new
   state (a rebase) and checks the hash before anything else.
3. ``acc = snapshot - local`` and the quorum's weighted average of it (``average``).
4. The commit point: a hash of a sample of the average, compared across the quorum in one tiny
   collective (its maximum and minimum). Only then the outer step on the snapshot (``core.outer``), the
   model's adoption of the new parameters, and the new state's hash reported to the server,
   which compares the members' hashes (the majority's state is the run's).

A failure before the commit point (a member died, a timeout) raises ``QuorumFailed``: the
snapshot and the model are as they were, the failure is reported, and the next quorum repeats
the round with a freshly computed pseudo-gradient. The commit collective itself may succeed on
some members and fail on others (two generals): those that passed apply the round, the others
remember the quorum, and when a later quorum hands them the state that quorum made (the server
names it, ``made_by``), they take it without keeping their already counted progress on top.
A quorum whose weights are all 0 (a start: every worker joins by one such round, receiving the
state if its own differs) takes no step. Memory: the model, the snapshot, the momentum and the
averaging buffer (4 models fp32).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from diloco.core import rebase_, to_progress_
from diloco.core.fragments import SEQUENTIAL
from diloco.core.outer import OuterSGD, apply_outer_step
from diloco.worker.allreduce.collective import (
    QuorumFailed,
    QuorumGroup,
    all_equal,
    average,
    broadcast,
    state_hash,
)
from diloco.worker.allreduce.shared_state import save_shared_state
from diloco.worker.session import Session
from diloco.worker.strategy import JoinAnswer
from diloco.worker.transport.client import SYNC_FAILURES, UnknownWorker

log = logging.getLogger(__name__)

SAMPLE = 1009
"""The commit point hashes every SAMPLE-th element of the average (a prime: no stride of a
parameter's shape lines up with it)."""

MAX_QUORUM_TRIES = 5
"""Quorums tried in one sync before training goes on locally (each failed one is discarded)."""


@dataclass(frozen=True)
class Quorum:
    """The server's answer to ``POST /quorum`` (docs/design.md, "All-reduce mode")."""

    id: str
    rank: int
    size: int
    round: int
    hash: str
    source: int
    resync: tuple[int, ...]
    host: str
    port: int
    timeout: float
    comm: torch.dtype  # what the quorum's all-reduce carries (bf16 when every member sends it)
    save: bool  # rank 0 writes a checkpoint after the round
    made_by: str  # the quorum whose step made the starting state ("" when unknown)

    @classmethod
    def of(cls, reply: Mapping[str, Any]) -> Quorum:
        rendezvous = reply["rendezvous"]
        return cls(
            id=str(reply["quorum_id"]),
            rank=int(reply["rank"]),
            size=int(reply["size"]),
            round=int(reply["round"]),
            hash=str(reply.get("hash") or ""),
            source=int(reply["source"]),
            resync=tuple(int(r) for r in reply.get("resync", [])),
            host=str(rendezvous["host"]),
            port=int(rendezvous["port"]),
            timeout=float(reply.get("timeout", 30.0)),
            comm=torch.bfloat16 if reply.get("comm") == "bf16" else torch.float32,
            save=bool(reply.get("save")),
            made_by=str(reply.get("made_by") or ""),
        )


class AllReduceSync:
    """The ``SyncStrategy`` of a server in all-reduce mode (plain sync, the whole model)."""

    def __init__(self, session: Session, reply: Mapping[str, Any]) -> None:
        self._s = session
        local = session.local
        local.own_snapshot()
        outer = reply.get("outer") or {}
        momentum = float(outer.get("momentum", 0.9))
        # The outer optimizer steps the snapshot in place: parameters sharing its memory.
        self._globals = [
            torch.nn.Parameter(t, requires_grad=False) for t in local.snapshot.values()
        ]
        self._outer = OuterSGD(
            self._globals,
            lr=float(outer.get("lr", 0.7)),
            momentum=momentum,
            nesterov=bool(outer.get("nesterov", True)) and momentum > 0,
        )
        # Momentum buffers exist from the start (zeros: the first step's ``0 * m + g`` is ``g``
        # exactly, as torch's first-step copy), so a joiner can receive them by broadcast.
        self._momentum: list[torch.Tensor] = []
        if momentum > 0:
            for p in self._globals:
                buf = torch.zeros_like(p)
                self._outer.state[p]["momentum_buffer"] = buf
                self._momentum.append(buf)
        self._acc = self._buffers()
        self._samples_weighting = reply.get("weighting") == "samples"
        self._hash = self._state_hash()
        # The model holds progress over a snapshot that is being replaced (a broadcast to this
        # worker broke off): it presents no state and syncs until it receives one.
        self._needs_state = False
        # A quorum whose commit point failed here after this worker's pseudo-gradient was in
        # its complete average, and the total steps then: the others may have applied it.
        self._uncertain: tuple[str, int] | None = None
        self._s.base_round = 0

    # --- SyncStrategy -------------------------------------------------------------------------

    @property
    def last_submission(self) -> str | None:
        return None  # nothing is held by the server

    @property
    def round(self) -> int:
        return self._s.base_round

    def configure(self, reply: Mapping[str, Any]) -> None:
        pass

    def joined(self, metadata: Mapping[str, str]) -> None:
        pass

    def join(self) -> None:
        """The start: one quorum round without a contribution, so this worker trains from the
        run's state (received from a member when its own differs). Waits for the quorum; a
        server that forgot this worker meanwhile (it restarted, or evicted it) is registered
        with again, and the wait goes on."""
        s = self._s
        while True:
            try:
                self._rejoin_if_forgotten()
                if self._one_sync(weighted=False) == "done":
                    return
            except UnknownWorker:
                s.need_rejoin.set()
            except SYNC_FAILURES as exc:
                log.warning("worker %s: waiting to join a quorum: %s", s.worker_id, exc)

    def rejoined(self, answer: JoinAnswer) -> str:
        return "kept locally (the workers hold the state in all-reduce mode)"

    def after_step(self) -> None:
        s = self._s
        if s.local_step >= s.sync_every or s.need_rejoin.is_set():
            self._sync()

    def sync_now(self) -> None:
        self._sync()

    def finish(self, *, submit: bool) -> None:
        if submit and self._s.local_step > 0:
            log.info(
                "worker %s leaves with %d local steps not averaged (all-reduce mode averages "
                "only among the workers of a quorum)",
                self._s.worker_id,
                self._s.local_step,
            )

    # --- one sync -----------------------------------------------------------------------------

    def _sync(self) -> None:
        """Average with a quorum, blocking the training loop (``_attempts``)."""
        s = self._s
        t0 = time.monotonic()
        s.syncing = True
        try:
            self._attempts()
        finally:
            s.syncing = False
            s.metrics["sync_time_s"] += time.monotonic() - t0

    def _attempts(self) -> bool:
        """Quorums until one completes: True then. Never raises a network error: when no
        quorum completes (``MAX_QUORUM_TRIES`` discarded, the wait for one past
        ``max_barrier_wait``, the server unreachable) False, and training goes on locally; the
        next sync tries again with the progress made until then. Only a worker left without
        state keeps trying until it gets one."""
        s = self._s
        wait = s.settings.max_barrier_wait
        deadline = time.monotonic() + wait if wait else None
        discarded = 0
        while True:
            try:
                self._rejoin_if_forgotten()
                outcome = self._one_sync(weighted=True)
            except UnknownWorker:
                s.need_rejoin.set()
                continue
            except SYNC_FAILURES as exc:
                s.metrics["failed_syncs"] += 1
                log.warning("worker %s: sync failed: %s", s.worker_id, exc)
                if self._needs_state:
                    continue  # the client's retries already waited between attempts
                return False
            if outcome == "done":
                s.metrics["rounds"] += 1
                self._synced()
                return True
            discarded += outcome == "discarded"
            late = deadline is not None and time.monotonic() > deadline
            if (discarded >= MAX_QUORUM_TRIES or late or self._given_up()) and (
                not self._needs_state
            ):
                s.metrics["failed_syncs"] += 1
                log.warning(
                    "worker %s: no quorum completed (%d discarded); training goes on",
                    s.worker_id,
                    discarded,
                )
                return False

    def _rejoin_if_forgotten(self) -> None:
        """Register again when the server forgot this worker (evicted, restarted: a 410)."""
        s = self._s
        if s.need_rejoin.is_set():
            s.rejoin()
            s.need_rejoin.clear()

    def _synced(self) -> None:
        """A round completed with this worker's contribution: its counters start again."""
        self._s.local_step = 0
        self._s.samples = 0.0

    def _given_up(self) -> bool:
        """True when the worker stops asking for quorums (it is leaving)."""
        return False

    def _one_sync(self, *, weighted: bool) -> str:
        """Ask for a quorum and run its round: ``"done"``, ``"pending"`` (the long poll ended
        first) or ``"discarded"`` (a member failed: counted, reported, nothing changed here)."""
        s = self._s
        assert s.worker_id is not None
        reply = s.client.quorum(
            s.worker_id, round=s.base_round, hash="" if self._needs_state else self._hash
        )
        if "quorum_id" not in reply:
            return "pending"
        q = Quorum.of(reply)
        try:
            new_round, new_hash = self._round(q, weighted)
        except QuorumFailed as exc:
            s.metrics["discarded_rounds"] += 1
            log.warning("worker %s: round discarded: %s", s.worker_id, exc)
            self._report(q, ok=False, error=str(exc))
            return "discarded"
        self._report(q, ok=True, round=new_round, hash=new_hash)
        return "done"

    def _round(self, q: Quorum, weighted: bool) -> tuple[int, str]:
        s = self._s
        with QuorumGroup.build(q.host, q.port, q.id, q.rank, q.size, q.timeout) as group:
            if q.resync:
                self._share_state(group, q)
            total = self._contribute(group, q, weighted)
        # The group is closed. Every member applies the same step to the same state, so the
        # new hashes agree; the server compares them, and a member whose hash is not the
        # majority's is sent the state at its next quorum.
        if total > 0:
            self._step(q)
            s.base_round = q.round + 1
        new_hash = self._hash = self._state_hash()
        if q.save and q.rank == 0:
            self._save(q)
        return s.base_round, new_hash

    def _contribute(self, group: QuorumGroup, q: Quorum, weighted: bool) -> float:
        """This worker's pseudo-gradient averaged over the quorum into ``self._acc``, checked at
        the commit point; the sum of the weights."""
        local = self._s.local
        weight = self._weight() if weighted else 0.0
        with torch.no_grad():
            for acc, (name, p) in zip(self._acc, local.params.items(), strict=True):
                torch.sub(local.snapshot[name], p.detach().to(acc.device), out=acc)
        return self._average(group, q, self._acc, weight)

    def _average(
        self, group: QuorumGroup, q: Quorum, tensors: list[torch.Tensor], weight: float
    ) -> float:
        total = average(group, tensors, weight, q.comm)
        # The payload averaged (on the wire a ring all-reduce moves about 2(N-1)/N of it each
        # way); the HTTP bytes stay in bytes_up/bytes_down.
        itemsize = torch.empty((), dtype=q.comm).element_size()
        self._s.metrics["collective_bytes"] += sum(t.numel() for t in tensors) * itemsize
        # The commit point: this tiny collective succeeds only once every member holds the
        # complete average; nothing has changed anywhere before it. It compares a sample of the
        # average (every SAMPLE-th element): a full CRC would cost 0.1 s per 100M parameters,
        # and the full hash of the new state is compared by the server.
        sample = [t.reshape(-1)[::SAMPLE] for t in tensors]
        try:
            same = all_equal(group, state_hash(sample))
        except QuorumFailed:
            if weight > 0:  # the others may have passed it and applied this worker's part
                self._uncertain = (q.id, self._s.total_steps)
            raise
        if not same:
            raise QuorumFailed(q.id, "the members' averages differ")
        self._uncertain = None  # the last quorum settled it either way
        return total

    def _step(self, q: Quorum) -> None:
        """The outer step on the shared state with the quorum's average; the model adopts it."""
        apply_outer_step(self._outer, self._globals, self._acc)
        self._s.local.adopt_all()

    def _buffers(self) -> list[torch.Tensor]:
        """Where the pseudo-gradient is averaged: one model's worth, fp32."""
        return [torch.empty_like(t) for t in self._s.local.snapshot.values()]

    def _share_state(self, group: QuorumGroup, q: Quorum) -> None:
        """The source's state to every member (those that hold it receive the same bytes); a
        member that needed it keeps its local progress on top (a rebase) once the agreed hash
        checks. A receiver whose broadcast broke off holds only its progress: it presents no
        state and trains no more until a later quorum hands it the state."""
        s, local = self._s, self._s.local
        receiving = q.rank in q.resync
        if receiving and not self._needs_state:
            local.each_param(to_progress_)
            self._needs_state = True  # the model holds progress; the snapshot is about to go
        broadcast(group, [*local.snapshot.values(), *self._momentum], q.source)
        if not receiving:
            return
        got = self._state_hash()
        if got != q.hash:
            raise QuorumFailed(q.id, f"state received has hash {got}, expected {q.hash}")
        uncertain, self._uncertain = self._uncertain, None
        if uncertain is not None and uncertain[0] == q.made_by:
            # The state received was made by the quorum whose commit point failed here: this
            # worker's pseudo-gradient is in it, so its progress up to then must not count
            # again (rebasing it would). Steps taken since are dropped with it.
            self._settle_counted(q, uncertain[1])
        else:
            local.each_param(rebase_)
        self._needs_state = False
        s.base_round = q.round
        self._hash = got
        s.metrics["rebases"] += 1

    def _settle_counted(self, q: Quorum, steps_then: int) -> None:
        """After a resync into a state holding this worker's last contribution (made by the
        round before ``q``'s): the model takes the state (its progress was counted)."""
        s = self._s
        s.local.adopt_all()
        s.local_step, s.samples = 0, 0.0  # nothing left to contribute: weight 0 next
        dropped = s.total_steps - steps_then
        log.warning(
            "worker %s: its contribution to the quorum whose commit point failed here is in "
            "the run's state; the model takes that state%s",
            s.worker_id,
            f" ({dropped} local steps since are dropped)" if dropped else "",
        )
        s.metrics["dropped_steps"] += dropped

    def _save(self, q: Quorum) -> None:
        """Rank 0: the run's state as a checkpoint of the server mode's layout."""
        state, layout = self._checkpoint_state()
        save_shared_state(self._s, q.id, state, layout, type(self._outer).__name__)

    def _checkpoint_state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The outer optimizer's state dict and the checkpoint fields that say how it is cut
        (the server mode's: one unit, the whole model)."""
        state = self._outer.state_dict()
        return state, {
            "fragments": [1, SEQUENTIAL],
            "unit_rounds": [self._s.base_round],
            "optimizer_units": [[len(self._globals), len(state["param_groups"])]],
        }

    def _weight(self) -> float:
        s = self._s
        if s.local_step == 0:
            return 0.0
        if self._samples_weighting:
            return s.samples if s.samples > 0 else float(s.local_step)
        return 1.0

    def _state_hash(self) -> str:
        return state_hash([*self._s.local.snapshot.values(), *self._momentum])

    def _report(self, q: Quorum, **outcome: Any) -> None:
        s = self._s
        assert s.worker_id is not None
        try:
            s.client.quorum_outcome(s.worker_id, q.id, **outcome)
        except SYNC_FAILURES as exc:  # the server learns it from the next quorum's hashes
            log.warning("worker %s: could not report round %s: %s", s.worker_id, q.id, exc)
