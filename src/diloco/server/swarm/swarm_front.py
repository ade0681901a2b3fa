"""Swarm mode's front (``ServerConfig.swarm``, ``server/front.py``'s ``Front``): the coordinator
of a pipeline whose stages live on the peers. It holds no parameters. It keeps the registry,
membership and health checks every mode has, and adds: a stage assigned at registration
(``assignment.py``), ``POST /swarm/ready`` checked against the stage's table and, where the
stage's replicas sync, against the states its quorums agreed on, the route table's
long poll, drivers' suspect reports (``stage_book.py``), and the peers' heartbeat measurements
in ``/status`` and ``/metrics``; and stage sync: each stage's replicas average with DiLoCo through
quorums of their own (``stage_quorums.py``: the all-reduce mode's quorum book, one per stage),
so ``/quorum``, ``/quorum/outcome`` and ``/rendezvous/*`` are served, and a registration carrying
a parameter table is checked against its stage's (``StageBook.check_table``, the same check
``/swarm/ready`` runs). The parameter server's routes answer 409 ``swarm_mode``.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import NoReturn

import torch

from diloco.server.config import ServerConfig
from diloco.server.errors import swarm_mode, unknown_worker
from diloco.server.members.codec_choice import registered_codec
from diloco.server.members.membership import Membership
from diloco.server.members.registry import WorkerRegistry
from diloco.server.observe.loss_history import LossHistory
from diloco.server.observe.metrics import SWARM_FAMILIES
from diloco.server.observe.records import IDLE, QuorumSummary, Saves
from diloco.server.observe.run_log import RunLog
from diloco.server.observe.status import Status, build_status
from diloco.server.swarm.stage_book import StageBook
from diloco.server.swarm.stage_quorums import LOSSY_REFUSED, SYNC_CODECS, StageQuorums
from diloco.wire.messages import (
    Deregistered,
    Heartbeat,
    HeartbeatReply,
    Kicked,
    LastSubmission,
    NumWorkersUpdated,
    OuterStep,
    Register,
    Registered,
    RegisterInfo,
    SaveRequested,
)
from diloco.wire.messages.swarm import (
    RouteTable,
    StageAccepted,
    StageReady,
    SuspectNoted,
    SuspectReport,
)

log = logging.getLogger(__name__)

TABLE_LIMIT = 1024 * 1024
"""A ready message carries the stage's parameter table: a name and shape per tensor."""


class SwarmMembers:
    """The run's ``Membership``, whose heartbeats also reach the stage book (a heartbeat ends
    a suspicion and carries the peer's measurements), and whose registrations carrying a
    parameter table are checked against the stage they would be given (the front's ``vet``:
    it needs the peer's id, which a mode's ``admit`` is not told)."""

    def __init__(self, inner: Membership, book: StageBook, vet: Callable[[Register], None]) -> None:
        self.inner = inner
        self.book = book
        self.vet = vet

    def register(self, asked: Register, hostname: str) -> Registered:
        self.vet(asked)
        return self.inner.register(asked, hostname)

    def deregister(self, worker_id: str, *, died: bool = False) -> Deregistered:
        return self.inner.deregister(worker_id, died=died)

    def heartbeat(self, beat: Heartbeat) -> HeartbeatReply:
        reply = self.inner.heartbeat(beat)  # 410 for a peer not registered, before the book
        self.book.heard(beat.worker_id, beat.swarm)
        move = self.book.moves.pop(beat.worker_id, None)
        return reply if move is None else replace(reply, move_to=move)

    def kick(self, worker_id: str) -> Kicked:
        return self.inner.kick(worker_id)

    def set_num_workers(self, num_workers: int) -> NumWorkersUpdated:
        return self.inner.set_num_workers(num_workers)


class SwarmFront:
    """The stages (``book``) of one server life."""

    register_limit = 64 * 1024
    metric_families = SWARM_FAMILIES
    mode = "swarm"
    store = None
    units: tuple[()] = ()
    uploads_waiting = 0
    fragmenting = None

    def __init__(self, config: ServerConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self.instance = uuid.uuid4().hex[:12]
        self.registry = WorkerRegistry(clock)
        self.run_log = RunLog(clock)
        self.loss_history = LossHistory(clock)
        self.book = StageBook(config.stages, config.min_replicas, clock)
        self.membership = SwarmMembers(
            Membership(config, self.registry, clock, self, lambda: None), self.book, self._vet
        )
        #: Each stage's replicas' quorums (stage sync).
        self.stage_quorums = StageQuorums(
            config,
            self.instance,
            self.book.assigned,
            clock,
            self._heartbeat_of,
            self.registry.touch,
        )

    def _heartbeat_of(self, worker_id: str) -> tuple[float, float] | None:
        record = self.registry.get(worker_id)
        if record is None:
            return None
        return record.last_seen, record.info.heartbeat_interval or 0.0

    def _vet(self, asked: Register) -> None:
        """409 ``params_mismatch`` for a registration whose table is not the table of the stage
        it would be assigned (``StageBook.pick``, what ``assign`` then gives); changes
        nothing."""
        table = asked.info.params
        if table is not None:
            stage = self.book.pick(asked.worker_id or "", asked.info.stages)
            self.book.check_table(stage, table)

    # --- lifecycle ------------------------------------------------------------------------------

    def open(self) -> None:
        self.stage_quorums.open()

    async def run(self) -> None:
        await asyncio.gather(self.membership.inner.health_loop(), self.stage_quorums.tick_loop())

    def close(self) -> None:
        self.stage_quorums.close()

    # --- membership (members/membership.py's Roster) --------------------------------------------

    def shown_round(self) -> int:
        return 0

    @property
    def num_workers(self) -> int:
        return self.config.num_workers

    def expected(self) -> int:
        return self.config.num_workers

    def admit(self, info: RegisterInfo) -> Callable[[str], None]:
        """The stages that fit the peer (400 ``no_fitting_stage`` when none is a stage here)
        and the codec its stage sync sends (422 ``codec_refused`` for a lossy one, as in
        all-reduce mode), checked before anything changes; the stage is assigned once it is
        registered, and a table the registration carries fixes the stage's if none is yet."""
        self.book.fits(info.stages)
        comm = registered_codec(info.codec, SYNC_CODECS, LOSSY_REFUSED) or "fp32"

        def counts(worker_id: str) -> None:
            before = self.book.assigned.get(worker_id)
            stage = self.book.assign(worker_id, info.stages)
            if info.params is not None:
                self.book.tables.setdefault(stage, info.params)
            self.stage_quorums.comm[worker_id] = comm
            self.stage_quorums.registered(worker_id, before, stage)
            log.info("peer %s hosts stage %d", worker_id, stage)

        return counts

    def told(self, reply: Registered, last_submission: str | None) -> Registered:
        """The peer's stage, and what its stage sync needs, as an all-reduce registration says
        it for a whole model: its stage's round, table and rendezvous, the collective timeout,
        the weighting, the outer step and the norm bound."""
        config = self.config
        stage = self.book.assigned[reply.worker_id]
        book = self.stage_quorums.books[stage]
        return replace(
            reply,
            mode=self.mode,
            round=book.round,
            instance=self.instance,
            has_params=False,
            last_submission=(
                None if last_submission is None else LastSubmission(None, in_params=False)
            ),
            params=self.book.tables.get(stage),
            rendezvous=book.rendezvous,  # None before the server listens (``open``)
            collective_timeout=config.collective_timeout,
            weighting=config.weighting,
            outer=OuterStep(config.outer_lr, config.momentum, config.nesterov),
            norm_bound=config.norm_bound,
            stage=stage,
            num_stages=self.book.num_stages,
        )

    def left(self, worker_id: str) -> None:
        stage = self.book.assigned.get(worker_id)
        self.book.left(worker_id)
        self.stage_quorums.left(worker_id, stage)
        for peer, before, after in self.book.rebalance():  # a stage's last replica left
            self.stage_quorums.registered(peer, before, after)
            log.warning("stage %d has no replica left: peer %s moves there from stage %d",
                        after, peer, before)  # fmt: skip

    def expect(self, num_workers: int) -> None:
        pass  # nothing waits for a count of peers: each stage's replicas are counted instead

    def checked(self) -> None:
        pass

    # --- routes ---------------------------------------------------------------------------------

    def parameters(self, what: str) -> NoReturn:
        raise swarm_mode(what)

    def quorums(self) -> StageQuorums:
        return self.stage_quorums

    def swarm(self) -> SwarmFront:
        return self

    def stage_ready(self, ready: StageReady) -> StageAccepted:
        """``POST /swarm/ready``: 410 for a peer not registered, then the stage book's checks
        (stage, table), then its stage's quorum book's (the state it holds, where the stage's
        replicas agreed on states), all before anything changes."""
        if self.registry.touch(ready.worker_id) is None:
            raise unknown_worker(ready.worker_id)
        self.book.check_ready(ready)
        self.stage_quorums.refuse_unheld(ready)
        version = self.book.mark_ready(ready)
        state = ready.state
        log.info(
            "peer %s ready for stage %d at %s (%s)",
            ready.worker_id,
            ready.stage,
            ready.address,
            "holding no state" if state is None else f"holding round {state[0]}, hash {state[1]}",
        )
        return StageAccepted(stage=ready.stage, version=version)

    async def routes(self, version: int) -> RouteTable:
        """``GET /swarm/routes?version=N``: a long poll bounded by ``poll_timeout``."""
        return await self.book.wait(version, self.config.poll_timeout)

    def suspect(self, report: SuspectReport) -> SuspectNoted:
        """``POST /swarm/suspect`` from a registered peer (410 otherwise)."""
        if self.registry.touch(report.worker_id) is None:
            raise unknown_worker(report.worker_id)
        version = self.book.report(report)
        log.warning(
            "peer %s reports %s (stage %d) suspect: %s",
            report.worker_id,
            report.suspect,
            report.stage,
            report.reason or "no reason given",
        )
        return SuspectNoted(version=version)

    async def request_save(self) -> tuple[int, SaveRequested]:
        """The peers hold the stages: rank 0 of each stage's next quorum saves."""
        reply = self.stage_quorums.request_save()
        log.info("control: checkpoint requested of every stage's next quorum")
        return 202, reply

    async def save(self) -> Path | None:
        return None  # the server holds nothing to save

    # --- status ---------------------------------------------------------------------------------

    def status(self, history_since: int = 0) -> Status:
        swarm = self.book.public()
        stages = tuple(
            replace(st, round=book.round, rounds_completed=book.rounds_completed)
            for st, book in zip(swarm.stages, self.stage_quorums.books, strict=True)
        )
        return replace(build_status(self, history_since), swarm=replace(swarm, stages=stages))

    def outer_optimizers(self) -> list[torch.optim.Optimizer]:
        return []

    def saves(self) -> Saves:
        return Saves()

    def quorum_state(self) -> QuorumSummary:
        return replace(IDLE, instance=self.instance)
