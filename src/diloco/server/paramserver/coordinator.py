"""The parameter server's front (``server/front.py``'s ``Front``: sync, async, streaming
fragments): it builds the parts, wires their callbacks, routes each request to the part that
owns it, and closes the rounds that are ready.

The parts (docs/design.md, "Who owns what"): ``Model`` (store, units, fragmenting),
``Membership`` with this mode's ``UnitRoster`` (registry, health, resume), ``Checkpoints``
(restore, save, publication), ``Intake`` (receive buffers, first writes, pending adds),
``Downloads`` (long polls and snapshots), ``RunLog`` (what happened), and per unit one
``Aggregator`` (sync rounds or async updates). The coordinator holds no state of its own beyond
the closing tasks.

Everything here runs on the server's event loop thread, so barrier and registry state need no
locks. Tensor work (adding an upload to a sum, an outer step) runs in worker threads; the tensor
lock orders it. No lock is held while bytes travel on a socket, with one exception: the round's
first upload owns its unit's sum while it arrives (server/intake/first_write.py), and an add
queued on the lock behind it waits for it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import NoReturn

import torch

from diloco.core import default_outer_optimizer, optimizer_hparams, set_optimizer_hparams
from diloco.core.delayed_nesterov import DelayedNesterov
from diloco.persistence import Checkpoint
from diloco.server.config import ServerConfig
from diloco.server.errors import ApiError, bad_request, not_swarm_mode, server_mode, unknown_worker
from diloco.server.front import JSON_LIMIT
from diloco.server.intake.intake import Intake
from diloco.server.intake.upload_body import UploadBody
from diloco.server.members.membership import Membership
from diloco.server.members.registry import WorkerRegistry
from diloco.server.observe.loss_history import LossHistory
from diloco.server.observe.records import IDLE, QuorumSummary, Saves
from diloco.server.observe.run_log import RunLog
from diloco.server.observe.status import Status, build_status
from diloco.server.params.store import ParamStore
from diloco.server.paramserver.downloads import Downloads
from diloco.server.paramserver.roster import UnitRoster
from diloco.server.rounds.aggregator import Aggregator, Verdict
from diloco.server.rounds.async_aggregator import AsyncAggregator
from diloco.server.rounds.barrier import SyncBarrier
from diloco.server.rounds.checkpoints import Checkpoints
from diloco.server.rounds.outer_steps import OuterSteps
from diloco.server.rounds.submissions import duplicate_reply, refusal
from diloco.server.rounds.sync_aggregator import SyncAggregator
from diloco.server.rounds.synced_model import Model
from diloco.server.rounds.units import OptimizerFactory, Unit
from diloco.wire import Layout
from diloco.wire.decode import AsyncStream
from diloco.wire.messages import (
    OptimizerUpdated,
    OuterHparams,
    ParamsSeeded,
    Saved,
    UploadMeta,
    UploadReceipt,
)

log = logging.getLogger(__name__)

__all__ = ["Coordinator", "OptimizerFactory", "SyncCoordinator"]


class Coordinator:
    """The parameter server's front. Sync or async, one unit or one per fragment."""

    register_limit = JSON_LIMIT
    metric_families = ()

    def __init__(
        self,
        config: ServerConfig,
        store: ParamStore | None,
        optimizer_factory: OptimizerFactory | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.clock = clock
        self.registry = WorkerRegistry(clock)
        self.model = Model(config, optimizer_factory or self._default_optimizer)
        lock = asyncio.Lock()  # orders tensor work: adds, outer steps, checkpoint writes
        self.run_log = RunLog(clock)
        self.loss_history = LossHistory(clock)
        self.checkpoints = Checkpoints(config, self.model, self.registry, lock)
        self.intake = Intake(config, self.model, self.registry, self.run_log, lock, clock)
        self.roster = UnitRoster(
            config, self.model, self.registry, clock, self._plan_units, self._maybe_close
        )
        self.membership = Membership(config, self.registry, clock, self.roster, self._maybe_close)
        self.steps = OuterSteps(
            config,
            clock,
            lock,
            self.model,
            self.checkpoints,
            self.run_log,
            self.registry.ids,
            self.intake.sum_free,
            wake=self.wake,
        )
        self.downloads = Downloads(config, self.model, self.registry, self.run_log)
        #: ``GET /global_params`` is the downloads' (paramserver/downloads.py).
        self.download = self.downloads.download
        self._closing_tasks: set[asyncio.Task[None]] = set()
        if store is not None:
            self._adopt_store(store)

    def _default_optimizer(self, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        config = self.config
        if config.delayed_nesterov:
            return DelayedNesterov(
                params,
                lr=config.outer_lr,
                momentum=config.momentum,
                buffer_size=config.dn_buffer_size or config.num_workers,
                activation=config.dn_activation,
            )
        return default_outer_optimizer(
            params, config.outer_lr, config.momentum, config.nesterov
        )

    # --- parameters and units -------------------------------------------------------------------

    def _aggregator(self, unit: Unit, round_: int) -> Aggregator:
        """The one place that picks a mode: a new mode is a new class here."""
        if self.config.mode == "sync":
            return SyncAggregator(unit, self.steps, round_)
        return AsyncAggregator(unit, self.steps, self.registry, round_)

    def _adopt_store(self, store: ParamStore, true: dict[str, torch.Tensor] | None = None) -> None:
        self.model.adopt(store, true)
        if self.model.fragmenting is not None:
            self._plan_units()

    def _plan_units(self) -> None:
        """Split the model into units once both the parameters and the fragmenting are known."""
        units = self.model.build(self.checkpoints.unit_rounds(), self._aggregator)
        self.checkpoints.load(units)
        self.intake.size_for(units)
        live = self.registry.ids()
        for unit in units:
            unit.aggregator.on_join(live)

    @property
    def store(self) -> ParamStore | None:
        return self.model.store

    @property
    def units(self) -> list[Unit]:
        return self.model.units

    @property
    def fragmenting(self) -> tuple[int, str] | None:
        return self.model.fragmenting

    @property
    def num_workers(self) -> int:
        return self.model.num_workers

    @property
    def mode(self) -> str:
        return self.config.mode

    @property
    def uploads_waiting(self) -> int:
        return self.intake.waiting

    def require_store(self) -> ParamStore:
        return self.model.require_store()

    def shown_round(self) -> int:
        return self.model.shown_round()

    @property
    def barrier(self) -> SyncBarrier | None:
        """The whole model's barrier (sync mode with one unit); None otherwise."""
        units = self.model.units
        agg = units[0].aggregator if len(units) == 1 else None
        return agg.barrier if isinstance(agg, SyncAggregator) else None

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The whole model's outer optimizer (one unit); None otherwise."""
        return self.units[0].optimizer if len(self.units) == 1 else None

    # --- checkpoints ----------------------------------------------------------------------------

    def restore(self, ckpt: Checkpoint) -> None:
        """Resume from a checkpoint (server/rounds/checkpoints.py)."""
        store = self.checkpoints.restore(ckpt)
        self._adopt_store(store, ckpt.true_params)
        if ckpt.round > 0:
            self.roster.resumed_at = self.clock()

    async def save(self) -> Path | None:
        """Write a checkpoint now; None when saving is not configured or nothing to save."""
        return await self.checkpoints.save()

    async def request_save(self) -> tuple[int, Saved]:
        """An operator's save, written now."""
        if self.config.save_dir is None:
            raise ApiError(
                409, "no_save_dir", "the server was started without --save-dir; nothing to save to"
            )
        try:
            path = await self.save()
        except OSError as exc:
            raise ApiError(
                500, "save_failed", f"the checkpoint could not be written: {exc}"
            ) from exc
        if path is None:
            raise ApiError(
                409,
                "nothing_to_save",
                "the server has no parameters yet (or no worker has set up the run): nothing to save",
            )
        round_ = self.status().round
        log.info("control: state saved to %s (round %s)", path, round_)
        return 200, Saved(path=str(path), round=round_)

    async def receive_initial(
        self, layout: Layout, stream: AsyncStream, worker_id: str
    ) -> ParamsSeeded:
        """The first worker provides the initial parameters when the server was started without."""
        store = await self.intake.receive_initial(layout, stream, worker_id)
        self._adopt_store(store)
        self.run_log.bytes_in += layout.total_size
        log.info(
            "initial parameters from worker %s: %d tensors, %d parameters",
            worker_id,
            len(store.specs),
            store.numel,
        )
        fragments, fragment_rounds = self.model.plan()
        return ParamsSeeded(
            round=store.round,
            num_params=store.numel,
            fragments=fragments,
            fragment_rounds=fragment_rounds,
        )

    # --- lifecycle and routes -------------------------------------------------------------------

    def open(self) -> None:
        pass  # nothing is hosted beside the parameters

    async def run(self) -> None:
        await self.membership.health_loop()

    def close(self) -> None:
        pass

    def parameters(self, what: str) -> Coordinator:
        return self

    def quorums(self) -> NoReturn:
        raise server_mode()

    def swarm(self) -> NoReturn:
        raise not_swarm_mode()

    def upload_limit(self) -> int:
        store = self.model.store
        return store.nbytes if store else self.config.max_initial_bytes

    # --- submissions ----------------------------------------------------------------------------

    async def submit(self, layout: Layout, stream: AsyncStream) -> UploadReceipt:
        """An upload: checked here against its unit's aggregator, received by the intake, which
        hands it to the aggregator; the coordinator then closes whatever became ready."""
        model = self.model
        store = model.require_store()
        head = UploadMeta.from_metadata(layout.metadata, weighting=self.config.weighting)
        record = self.registry.get(head.worker_id)
        if record is None:
            raise unknown_worker(head.worker_id)
        unit = model.unit_of(head.fragment)
        body = UploadBody.read(layout, unit.table, self.config.allowed_codecs)
        agg, fragment = unit.aggregator, model.fragment_of(unit)
        check = agg.check(head.worker_id, head.base_round, head.submission_id)
        if check.verdict is Verdict.DUPLICATE:
            return duplicate_reply(
                check, head.submission_id, store.instance, agg.versioned, fragment
            )
        if check.verdict is not Verdict.ACCEPT:
            self.run_log.rejected += 1
            if check.verdict is Verdict.TOO_STALE:
                raise self.steps.too_stale(unit, head.base_round, check.staleness)
            raise refusal(check, head.base_round, fragment)
        agg.begin_upload(head.worker_id, head.submission_id)
        try:
            counted = await self.intake.receive(unit, layout, body, stream, head)
        except BaseException:
            agg.abort_upload(head.worker_id, head.submission_id)
            self._maybe_close()
            raise
        self.registry.touch(head.worker_id)
        record.submissions += 1
        record.last_round = head.base_round
        record.bytes_in += layout.total_size
        record.codec = body.name  # what it sends, whatever it registered with
        self.run_log.received(unit.index, layout.total_size)
        if head.loss is not None:
            record.loss = head.loss  # as a heartbeat's: shown even with heartbeats off
        if head.steps is not None:
            self.registry.counted_steps(record, head.steps)
        if unit.index == 0:  # with fragments: one entry per worker per sync period
            self.loss_history.record(head.base_round, head.worker_id, head.loss, head.steps)
        self._maybe_close()
        refused = self.run_log.refused_rounds.get(unit.index)
        return replace(
            counted,
            submission_id=head.submission_id,
            instance=model.require_store().instance,
            fragment=fragment,
            refused_rounds=tuple(refused) if refused else None,
        )

    # --- closing --------------------------------------------------------------------------------

    def wake(self) -> None:
        """Close whatever became ready with time alone (a quorum round's grace ended): the
        aggregators' timers call it; tests call it after moving a fake clock."""
        self._maybe_close()

    def _maybe_close(self) -> None:
        """Close every unit whose aggregator is ready (each close runs as its own task)."""
        if self.model.store is None:
            return
        for unit in self.model.units:
            if unit.aggregator.ready():
                round_ = unit.aggregator.begin_close()
                task = asyncio.get_running_loop().create_task(self._close(unit, round_))
                self._closing_tasks.add(task)
                task.add_done_callback(self._closing_tasks.discard)

    async def settle(self) -> None:
        """Wait for the outer steps under way (tests, shutdown)."""
        while self._closing_tasks:
            await asyncio.gather(*list(self._closing_tasks), return_exceptions=True)

    async def _close(self, unit: Unit, round_: int) -> None:
        try:
            await unit.aggregator.close(round_)
        except Exception:  # the round stays closing; nothing would make it succeed on retry
            log.exception("outer step of round %d (fragment %d) failed", round_, unit.index)
            raise
        self._maybe_close()

    # --- control --------------------------------------------------------------------------------

    def outer_optimizers(self) -> list[torch.optim.Optimizer]:
        """Every outer optimizer the server steps (one per fragment when streaming)."""
        return [u.optimizer for u in self.model.units]

    def set_outer_hparams(
        self, lr: float | None = None, momentum: float | None = None
    ) -> OptimizerUpdated:
        """Change the outer learning rate and/or momentum of every outer optimizer. Validated
        before anything changes."""
        if lr is not None and not (math.isfinite(lr) and lr > 0):
            raise bad_request("bad_field", f"lr must be a finite positive number, got {lr}")
        if momentum is not None and not (math.isfinite(momentum) and 0 <= momentum < 1):
            raise bad_request("bad_field", f"momentum must be in [0, 1), got {momentum}")
        optimizers = self.outer_optimizers()
        if not optimizers:
            raise ApiError(503, "no_parameters", "the server has no parameters yet")
        if momentum is not None and any(
            "momentum" not in g for o in optimizers for g in o.param_groups
        ):
            raise bad_request("bad_field", "the outer optimizer has no momentum to set")
        for opt in optimizers:
            set_optimizer_hparams(opt, lr=lr, momentum=momentum)
        log.info("outer optimizer changed: lr=%s momentum=%s", lr, momentum)
        return OptimizerUpdated(outer_optimizer=OuterHparams(**optimizer_hparams(optimizers[0])))

    # --- status ---------------------------------------------------------------------------------

    def status(self, history_since: int = 0) -> Status:
        """``GET /status`` (``server/observe/status.py`` builds and types it), its loss history
        from round ``history_since`` on."""
        return build_status(self, history_since)

    def saves(self) -> Saves:
        cp = self.checkpoints
        return Saves(cp.last_save, cp.last_save_error, cp.resumed_from)

    def quorum_state(self) -> QuorumSummary:
        return IDLE


SyncCoordinator = Coordinator  # the name before async mode; kept for callers
