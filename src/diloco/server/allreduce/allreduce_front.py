"""All-reduce mode's front (``ServerConfig.allreduce``, ``server/front.py``'s ``Front``). The
workers average among themselves, meeting at a rendezvous the server serves on its own
authenticated API (``rendezvous.py``); the server holds no parameters. It keeps the same registry, membership and health checks as the
parameter server, and adds: each registration's parameter table checked against the run's
(``run_table.py``) and the reply's additions, ``POST /quorum`` and ``POST /quorum/outcome``
(``quorum_book.py``), and an operator's save passed to the next quorum.
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

from diloco.core.codecs import codec_by_name
from diloco.server.allreduce.quorum_book import QuorumBook, resume_grace
from diloco.server.allreduce.rendezvous import RendezvousStore
from diloco.server.allreduce.run_table import RunTable
from diloco.server.config import ServerConfig
from diloco.server.errors import allreduce_mode, not_swarm_mode
from diloco.server.members.codec_choice import codec_refused, parse_codec, registered_codec
from diloco.server.members.fragmenting import asked_fragmenting, configured_fragmenting
from diloco.server.members.membership import Membership
from diloco.server.members.registry import WorkerRegistry
from diloco.server.observe.loss_history import LossHistory
from diloco.server.observe.metrics import QUORUM_FAMILIES
from diloco.server.observe.records import QuorumSummary, Saves
from diloco.server.observe.run_log import RunLog
from diloco.server.observe.status import Status, build_status
from diloco.wire.messages import (
    Assignment,
    LastSubmission,
    OutcomeRecorded,
    OuterStep,
    QuorumAsk,
    QuorumOutcome,
    Registered,
    RegisterInfo,
    Rendezvous,
    SaveRequested,
)
from diloco.wire.messages.rendezvous import PATH as RENDEZVOUS_PATH

log = logging.getLogger(__name__)

ALLREDUCE_CODECS = ("fp32", "bf16", "int8", "int4", "topk")
"""What a quorum's all-reduce carries, narrowest last: a quorum's ``comm`` is the widest its
members registered (``quorum_comm``). int8 and int4 travel as blockwise codes with each member's
error feedback, reduced shard by shard in fp32 and requantized; topk as each member's sparse
parts, all-gathered and summed (worker/allreduce/quantized.py)."""
ENCODED = ("int8", "int4", "topk")
"""The codecs whose collectives decode what every member encoded: their default options only."""
LOSSY_REFUSED = (
    "the all-reduce mode averages fp32, bf16, int8, int4 or topk; lowrank is not built for its "
    "collectives: run the server without --allreduce to use it"
)
"""Why another lossy codec is refused in this mode: the mode, not ``--codecs``, is the cause."""


def quorum_comm(registered: list[str]) -> str:
    """The widest codec among the members' (``ALLREDUCE_CODECS``' order; fp32 for a member
    that named none): one encoding per collective, and no member's contribution narrowed past
    what it asked for."""
    return min(registered, key=ALLREDUCE_CODECS.index, default="fp32")


TABLE_LIMIT = 1024 * 1024
"""A registration here carries the parameter table: a name and shape per tensor."""


class AllReduceFront:
    """The quorums (``book``) and the run's parameter table (``table``) of one server life, and
    the rendezvous (``rendezvous``) while the server runs."""

    register_limit = TABLE_LIMIT
    metric_families = QUORUM_FAMILIES
    mode = "allreduce"
    # What a status shows of parameters, checkpoints and uploads: this server has none.
    store = None
    units: tuple[()] = ()
    uploads_waiting = 0

    def __init__(self, config: ServerConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self.registry = WorkerRegistry(clock)
        self.run_log = RunLog(clock)
        self.loss_history = LossHistory(clock)
        self.membership = Membership(config, self.registry, clock, self, lambda: None)
        self.table = RunTable()
        self.fragmenting = configured_fragmenting(config)
        self._comm: dict[str, str] = {}  # worker id -> its ALLREDUCE_CODECS name, registered
        self.book = QuorumBook(
            instance=uuid.uuid4().hex[:12],
            live=self.registry.ids,
            clock=clock,
            min_workers=config.min_workers,
            num_workers=config.num_workers,
            join_timeout=config.join_timeout,
            collective_timeout=config.collective_timeout,
            poll_margin=config.poll_timeout,
            save_every=config.save_every,
            resume_grace=resume_grace(config.heartbeat_timeout, config.collective_timeout),
            heartbeat_of=self._heartbeat_of,
        )
        #: The keys each quorum meets at, while the server runs (``open``).
        self.rendezvous: RendezvousStore | None = None

    def _heartbeat_of(self, worker_id: str) -> tuple[float, float] | None:
        """When the server last heard from the worker and its heartbeat interval (0: none, or
        a worker too old to say)."""
        record = self.registry.get(worker_id)
        if record is None:
            return None
        return record.last_seen, record.info.heartbeat_interval or 0.0

    # --- lifecycle ------------------------------------------------------------------------------

    def open(self) -> None:
        """The rendezvous, in memory and served by the server's routes, for as long as the
        server runs: a member may touch the keys of its own quorum only (the book's)."""
        # Its waits are asyncio's, in real time: not on the front's clock, which tests fake.
        self.rendezvous = RendezvousStore(
            self.book.members_of, max_wait=self.config.collective_timeout
        )
        self.book.rendezvous = Rendezvous(path=RENDEZVOUS_PATH)
        self.book.forget = self.rendezvous.forget

    async def run(self) -> None:
        await asyncio.gather(self.membership.health_loop(), self.book.tick_loop())

    def close(self) -> None:
        if self.rendezvous is not None:
            self.rendezvous.close()
            self.rendezvous = None

    # --- membership (members/membership.py's Roster) --------------------------------------------

    def shown_round(self) -> int:
        return self.book.round

    @property
    def num_workers(self) -> int:
        return self.book.num_workers

    def expected(self) -> int:
        return self.book.num_workers

    def admit(self, info: RegisterInfo) -> Callable[[str], None]:
        """A registration's table and codec checked (400 ``missing_params_table``, 409
        ``params_mismatch``, 422 ``codec_refused`` for lowrank, or int8, int4 or topk with other
        than their default options), and its fragmenting, before
        anything changes."""
        table = self.table.check(info.params)
        comm = registered_codec(info.codec, ALLREDUCE_CODECS, LOSSY_REFUSED) or "fp32"
        if info.codec is not None and comm in ENCODED:
            default = codec_by_name(comm).options()
            if parse_codec(info.codec).options() != default:
                # Every member must cut the same blocks or chunks: the codes are decoded as one.
                raise codec_refused(
                    f"{comm} with options {parse_codec(info.codec).options()}",
                    ALLREDUCE_CODECS,
                    f"the all-reduce mode's {comm} collectives use {default}",
                )
        asked = asked_fragmenting(info.fragmenting, self.config, self.fragmenting)

        def counts(worker_id: str) -> None:
            if self.fragmenting is None:
                self.fragmenting = asked
                log.info("fragmenting %s set by worker %s", asked, worker_id)
            self.table.adopt(table)
            self._comm[worker_id] = comm
            self.book.registered(worker_id)  # a leave until it registers again ends

        return counts

    def told(self, reply: Registered, last_submission: str | None) -> Registered:
        """The mode, the rendezvous, the collective timeout, the run's table and the outer
        optimizer every worker must step identically; no parameters here, so no upload was
        ever counted in them."""
        config = self.config
        return replace(
            reply,
            mode=self.mode,
            round=self.book.round,
            instance=self.book.instance,
            has_params=False,
            fragments=None,
            fragment_rounds=None,
            last_submission=(
                None if last_submission is None else LastSubmission(None, in_params=False)
            ),
            params=self.table.table,
            rendezvous=self.book.meeting_point(),
            collective_timeout=config.collective_timeout,
            weighting=config.weighting,
            outer=OuterStep(config.outer_lr, config.momentum, config.nesterov),
            norm_bound=config.norm_bound,
        )

    def left(self, worker_id: str) -> None:
        self.book.on_leave(worker_id)

    def expect(self, num_workers: int) -> None:
        """The first quorum of a fresh run waits for this many workers."""
        self.book.num_workers = num_workers
        self.book.tick()

    def checked(self) -> None:
        pass  # the book acts on its own deadlines (``run``)

    # --- routes ---------------------------------------------------------------------------------

    def parameters(self, what: str) -> NoReturn:
        raise allreduce_mode(what)

    def quorums(self) -> AllReduceFront:
        return self

    def swarm(self) -> NoReturn:
        raise not_swarm_mode()

    @property
    def round(self) -> int:
        return self.book.round

    def round_of(self, worker_id: str) -> int:
        return self.book.round  # one run, one round

    async def quorum(self, ask: QuorumAsk) -> Assignment | None:
        """The worker's quorum reply (``book.ask``: 410, 409 ``left_out`` or
        ``unagreed_state``); its weight, bounded by the message (400 ``bad_field``), is logged:
        the members exchange their weights among themselves."""
        ticket = self.book.ask(ask)
        if ask.weight is not None:
            log.debug("worker %s asks for a quorum with weight %g", ask.worker_id, ask.weight)
        self.registry.touch(ask.worker_id)  # a worker asking is alive, and has joined
        reply = await self.book.wait(ticket, self.config.poll_timeout)
        if reply is None:
            return None
        comm = quorum_comm([self._comm.get(m, "fp32") for m in reply.members])
        return replace(reply, comm=comm)

    def outcome(self, outcome: QuorumOutcome) -> OutcomeRecorded:
        reply = self.book.report(outcome)
        self.registry.touch(outcome.worker_id)
        return reply

    async def request_save(self) -> tuple[int, SaveRequested]:
        """The workers hold the state: rank 0 of the next quorum saves."""
        reply = self.book.request_save()
        log.info("control: checkpoint requested of the next quorum (round %s)", reply.round)
        return 202, reply

    async def save(self) -> Path | None:
        return None  # the server holds nothing to save

    # --- status ---------------------------------------------------------------------------------

    def status(self, history_since: int = 0) -> Status:
        return build_status(self, history_since)

    def outer_optimizers(self) -> list[torch.optim.Optimizer]:
        return []

    def saves(self) -> Saves:
        return Saves()

    def quorum_state(self) -> QuorumSummary:
        # The model's size is known from the first registration's table, not from parameters.
        return replace(self.book.public(), num_params=self.table.numel)
