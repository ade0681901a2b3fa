"""Swarm mode's front (``ServerConfig.swarm``, ``server/front.py``'s ``Front``): the coordinator
of a pipeline whose stages live on the peers. It holds no parameters. It keeps the registry,
membership and health checks every mode has, and adds: a stage assigned at registration
(``assignment.py``), ``POST /swarm/ready`` checked against the stage's table, the route table's
long poll, drivers' suspect reports (``stage_book.py``), and the peers' heartbeat measurements
in ``/status`` and ``/metrics``.

The peers' own stage sync (replicas of a stage averaging with DiLoCo) is not served here yet:
``/quorum`` answers 409 ``swarm_mode``, as do the parameter server's routes.
"""

from __future__ import annotations

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
from diloco.server.members.membership import Membership
from diloco.server.members.registry import WorkerRegistry
from diloco.server.observe.loss_history import LossHistory
from diloco.server.observe.metrics import SWARM_FAMILIES
from diloco.server.observe.records import IDLE, QuorumSummary, Saves
from diloco.server.observe.run_log import RunLog
from diloco.server.observe.status import Status, build_status
from diloco.server.swarm.stage_book import StageBook
from diloco.wire.messages import (
    Deregistered,
    Heartbeat,
    HeartbeatReply,
    Kicked,
    NumWorkersUpdated,
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
    a suspicion and carries the peer's measurements)."""

    def __init__(self, inner: Membership, book: StageBook) -> None:
        self.inner = inner
        self.book = book

    def register(self, asked: Register, hostname: str) -> Registered:
        return self.inner.register(asked, hostname)

    def deregister(self, worker_id: str, *, died: bool = False) -> Deregistered:
        return self.inner.deregister(worker_id, died=died)

    def heartbeat(self, beat: Heartbeat) -> HeartbeatReply:
        reply = self.inner.heartbeat(beat)  # 410 for a peer not registered, before the book
        self.book.heard(beat.worker_id, beat.swarm)
        return reply

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
            Membership(config, self.registry, clock, self, lambda: None), self.book
        )
        self._fits: dict[str, list[int]] = {}

    # --- lifecycle ------------------------------------------------------------------------------

    def open(self) -> None:
        pass

    async def run(self) -> None:
        await self.membership.inner.health_loop()

    def close(self) -> None:
        pass

    # --- membership (members/membership.py's Roster) --------------------------------------------

    def shown_round(self) -> int:
        return 0

    @property
    def num_workers(self) -> int:
        return self.config.num_workers

    def expected(self) -> int:
        return self.config.num_workers

    def admit(self, info: RegisterInfo) -> Callable[[str], None]:
        """The stages that fit the peer (400 ``no_fitting_stage`` when none is a stage here),
        checked before anything changes; the stage is assigned once it is registered."""
        self.book.fits(info.stages)

        def counts(worker_id: str) -> None:
            stage = self.book.assign(worker_id, info.stages)
            log.info("peer %s hosts stage %d", worker_id, stage)

        return counts

    def told(self, reply: Registered, last_submission: str | None) -> Registered:
        return replace(
            reply,
            mode=self.mode,
            instance=self.instance,
            has_params=False,
            stage=self.book.assigned[reply.worker_id],
            num_stages=self.book.num_stages,
        )

    def left(self, worker_id: str) -> None:
        self.book.left(worker_id)

    def expect(self, num_workers: int) -> None:
        pass  # nothing waits for a count of peers: each stage's replicas are counted instead

    def checked(self) -> None:
        pass

    # --- routes ---------------------------------------------------------------------------------

    def parameters(self, what: str) -> NoReturn:
        raise swarm_mode(what)

    def quorums(self) -> NoReturn:
        raise swarm_mode("stage sync among a stage's replicas is not served yet")

    def swarm(self) -> SwarmFront:
        return self

    def stage_ready(self, ready: StageReady) -> StageAccepted:
        """``POST /swarm/ready``: 410 for a peer not registered, then the book's checks."""
        if self.registry.touch(ready.worker_id) is None:
            raise unknown_worker(ready.worker_id)
        version = self.book.mark_ready(ready)
        log.info("peer %s ready for stage %d at %s", ready.worker_id, ready.stage, ready.address)
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
        raise swarm_mode("the stages' checkpoints are the peers' (stage sync is not served yet)")

    async def save(self) -> Path | None:
        return None  # the server holds nothing to save

    # --- status ---------------------------------------------------------------------------------

    def status(self, history_since: int = 0) -> Status:
        return replace(build_status(self, history_since), swarm=self.book.public())

    def outer_optimizers(self) -> list[torch.optim.Optimizer]:
        return []

    def saves(self) -> Saves:
        return Saves()

    def quorum_state(self) -> QuorumSummary:
        return replace(IDLE, instance=self.instance)
