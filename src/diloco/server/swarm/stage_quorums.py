"""Stage sync in swarm mode: the replicas of each pipeline stage run DiLoCo among themselves
with the all-reduce mode's quorums, one quorum series per stage.

It is the all-reduce mode's machinery, reused whole: one ``QuorumBook`` per stage
(``server/allreduce/quorum_book.py``: forming, the commit point, the agreed states a joiner is
resynced to, the left-out rules, the save requests) whose live workers are the registered peers
assigned that stage, and one ``RendezvousStore`` (``server/allreduce/rendezvous.py``) shared by
the stages: quorum ids carry their stage's book instance (``<instance>-s<k>-<n>``), so a
member's keys are checked against the one book that formed its quorum. A peer's ``POST /quorum``
and ``POST /quorum/outcome`` reach the book of the stage it was assigned at registration; a peer
not assigned one (not registered) gets the book's 410. The workers do the averaging, the
checks and the checkpoints (``worker/allreduce/``), exactly as in all-reduce mode.

Event loop thread only; the clock is injected (tests fake it).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import replace

from diloco.server.allreduce.quorum_book import QuorumBook, resume_grace
from diloco.server.allreduce.rendezvous import RendezvousStore
from diloco.server.allreduce.suspects import HeartbeatOf
from diloco.server.config import ServerConfig
from diloco.server.errors import unknown_worker
from diloco.wire.messages import (
    Assignment,
    OutcomeRecorded,
    QuorumAsk,
    QuorumOutcome,
    Rendezvous,
    SaveRequested,
)
from diloco.wire.messages.rendezvous import PATH as RENDEZVOUS_PATH
from diloco.wire.messages.swarm import StageReady

SYNC_CODECS = ("fp32", "bf16")
"""What a stage's quorum sums, as the all-reduce mode's (``allreduce_front.ALLREDUCE_CODECS``:
quantized codes with per-replica scales cannot be summed). A registration's ``info.codec`` is
its stage sync's; the boundaries' codecs are the stage services' own and never named there."""
LOSSY_REFUSED = (
    "a stage's replicas sum their pseudo-gradients in their quorum, and quantized codes with "
    "per-replica scales cannot be summed: register with fp32 or bf16 communication (the "
    "boundaries' activation codecs are set on the peers, not here)"
)


class StageQuorums:
    """One ``QuorumBook`` per stage (``books[k]``) and the rendezvous they share while the
    server runs. ``assigned``: the stage book's peer -> stage (read live, never copied)."""

    def __init__(
        self,
        config: ServerConfig,
        instance: str,
        assigned: Mapping[str, int],
        clock: Callable[[], float],
        heartbeat_of: HeartbeatOf,
        touch: Callable[[str], object],
    ) -> None:
        self.config = config
        self._assigned = assigned
        self._touch = touch  # a peer asking or reporting is alive
        #: worker id -> "fp32" or "bf16", from its registration (``SYNC_CODECS``).
        self.comm: dict[str, str] = {}
        self.books = [
            QuorumBook(
                instance=f"{instance}-s{k}",
                live=self._live_of(k),
                clock=clock,
                # A stage's first quorum waits for the replicas the coordinator fills every
                # stage to; after that a single replica still syncs (its rounds, checkpoints).
                min_workers=1,
                num_workers=config.min_replicas,
                join_timeout=config.join_timeout,
                collective_timeout=config.collective_timeout,
                poll_margin=config.poll_timeout,
                save_every=config.save_every,
                resume_grace=resume_grace(config.heartbeat_timeout, config.collective_timeout),
                heartbeat_of=heartbeat_of,
            )
            for k in range(config.stages)
        ]
        #: The stages' keys, while the server runs (``open``).
        self.rendezvous: RendezvousStore | None = None

    def _live_of(self, stage: int) -> Callable[[], set[str]]:
        # Every leave, eviction and kick takes the peer out of ``assigned`` (``StageBook.left``),
        # so the stage's assigned peers are its registered replicas.
        return lambda: {p for p, k in self._assigned.items() if k == stage}

    # --- lifecycle ------------------------------------------------------------------------------

    def open(self) -> None:
        """The shared rendezvous: a member touches the keys of its own quorum only, whichever
        stage's book formed it."""
        self.rendezvous = RendezvousStore(self._members_of, max_wait=self.config.collective_timeout)
        for book in self.books:
            book.rendezvous = Rendezvous(path=RENDEZVOUS_PATH)
            book.forget = self.rendezvous.forget

    def close(self) -> None:
        if self.rendezvous is not None:
            self.rendezvous.close()
            self.rendezvous = None

    async def tick_loop(self) -> None:
        await asyncio.gather(*(book.tick_loop() for book in self.books))

    def _members_of(self, quorum_id: str) -> tuple[str, ...] | None:
        for book in self.books:
            members = book.members_of(quorum_id)
            if members is not None:
                return members
        return None

    # --- membership -----------------------------------------------------------------------------

    def book_of(self, worker_id: str) -> QuorumBook:
        """The book of the peer's stage; 410 for a peer not registered (so not assigned)."""
        stage = self._assigned.get(worker_id)
        if stage is None:
            raise unknown_worker(worker_id)
        return self.books[stage]

    def registered(self, worker_id: str, before: int | None, stage: int) -> None:
        """The peer registered (again) for ``stage``; ``before``: the stage it had (None: none).
        A move between stages is a leave of the old stage's quorums."""
        if before is not None and before != stage:
            self.books[before].on_leave(worker_id)
        self.books[stage].registered(worker_id)

    def left(self, worker_id: str, stage: int | None) -> None:
        self.comm.pop(worker_id, None)
        if stage is not None:
            self.books[stage].on_leave(worker_id)

    def refuse_unheld(self, ready: StageReady) -> None:
        """A replica of a stage whose replicas agreed on states says ready only holding one of
        them (``QuorumBook.refuse_unheld``: 409 ``state_required``, ``unagreed_state``); a
        stage with none (no stage sync) takes any. Run after the stage book's checks (the
        ready's stage is the peer's). Changes nothing."""
        self.books[ready.stage].refuse_unheld(ready.worker_id, ready.state)

    # --- routes (server/front.py's Quorums) -----------------------------------------------------

    def round_of(self, worker_id: str) -> int:
        """The round of the peer's stage (a pending reply names it); 0 for a peer unknown."""
        stage = self._assigned.get(worker_id)
        return 0 if stage is None else self.books[stage].round

    async def quorum(self, ask: QuorumAsk) -> Assignment | None:
        """The peer's quorum among its stage's replicas (the book's 410 and 409s), as the
        all-reduce front answers it: bf16 when every member sends bf16, else fp32."""
        book = self.book_of(ask.worker_id)
        ticket = book.ask(ask)
        self._touch(ask.worker_id)
        reply = await book.wait(ticket, self.config.poll_timeout)
        if reply is None:
            return None
        both = all(self.comm.get(m) == "bf16" for m in reply.members)
        return replace(reply, comm="bf16" if both else "fp32")

    def outcome(self, outcome: QuorumOutcome) -> OutcomeRecorded:
        reply = self.book_of(outcome.worker_id).report(outcome)
        self._touch(outcome.worker_id)
        return reply

    def request_save(self) -> SaveRequested:
        """Rank 0 of every stage's next quorum saves; the reply names the lowest stage round."""
        rounds = [book.request_save().round for book in self.books]
        return SaveRequested(round=min(rounds))
