"""The server's state as a typed, frozen dataclass: ``GET /status`` is ``build_status(front)
.to_json()``, ``/metrics`` and ``diloco status`` read the same fields as attributes, and the
dashboard's keys are checked against them by a test. A renamed field breaks mypy or a test, not
a display that quietly shows ``-``. The records it is made of are ``server/observe/records.py``.

JSON mapping (``status_json.py``): a field is a key, in field order; a tuple is a list; a field marked
``OMIT`` is left out of the JSON while it is ``None`` (keys one mode has and the other lacks:
``submitted`` of an async fragment, ``staleness`` of a sync update, ``momentum`` of an
optimizer without one).

Either front is read through one protocol, ``Observed``: a front without parameters (all-reduce
mode) has no store and no units, as a parameter server has none before its first upload; one
without quorums shows ``IDLE``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch

from diloco.core.delayed_nesterov import DelayedNesterov
from diloco.core.outer import optimizer_hparams
from diloco.server.config import ServerConfig
from diloco.server.members.rates import Rate
from diloco.server.members.registry import WorkerRegistry
from diloco.server.observe.records import (
    OMIT,
    DelayedNesterovSettings,
    FragmentStatus,
    LeftOutStatus,
    OuterOptimizer,
    QuorumRounds,
    QuorumStatus,
    QuorumSummary,
    Refusal,
    RobustAggregation,
    RoundLoss,
    SaveRecord,
    Saves,
    Staleness,
    State,
    UpdateEntry,
    UpstreamStatus,
    WorkerExclusions,
    WorkerStatus,
)
from diloco.server.observe.status_json import from_json, to_json
from diloco.server.observe.swarm_records import SwarmStatus
from diloco.server.params.store import F32_BYTES, ParamStore

STATUS_LOG = 200  # updates of the run log that /status shows (the newest)


@dataclass(frozen=True)
class Status:
    """What ``GET /status`` answers, key for key."""

    mode: str
    instance: str | None
    uptime_s: float
    # The round and its barrier (sync, one unit shown) or what stands for them (async).
    round: int
    opened: bool
    num_workers: int
    min_workers: int
    expected: tuple[str, ...]
    submitted: tuple[str, ...]
    uploading: tuple[str, ...]
    closing: bool
    updates: int
    fragments: tuple[FragmentStatus, ...] | None  # only with more than one fragment
    fragment_pattern: str | None
    has_params: bool
    num_params: int
    model_bytes: int
    # Outer steps that had to copy the parameters because a download still held them.
    copies_on_write: int
    outer_optimizer: OuterOptimizer | None
    outer_optimizer_class: str | None
    delayed_nesterov: DelayedNesterovSettings | None
    weighting: str
    staleness_weighting: str
    staleness_cutoff: int | None
    max_staleness: int | None
    staleness: Staleness
    dylu: bool
    bytes_in: int
    bytes_out: int
    rejected_submissions: int
    kicks: int
    refused_updates: int
    last_refusal: Refusal | None
    robust_aggregation: RobustAggregation | None
    last_round_contributions: int
    last_round_time_s: float | None
    upload_slots: int
    uploads_waiting: int
    last_round_upload_wait_max_s: float | None
    update_log: tuple[UpdateEntry, ...]
    registrations: int
    worker_deaths: int
    heartbeat_timeout: float
    stuck_timeout: float
    join_timeout: float
    save_dir: str | None
    last_save: SaveRecord | None
    last_save_error: str | None
    resumed_from: str | None
    workers: tuple[WorkerStatus, ...]
    # The last rounds' reported losses, oldest first (``GET /status?history_since=R``: from
    # round R on). A default, so a document from a server before it still parses.
    loss_history: tuple[RoundLoss, ...] = ()
    # Codecs: those the live workers upload with, those this server takes; the last update's
    # bytes each way (its ``round_bytes_in``/``round_bytes_out``). Defaults, as above.
    codecs: tuple[str, ...] = ()
    allowed_codecs: tuple[str, ...] = ()
    last_round_bytes_in: int | None = None
    last_round_bytes_out: int | None = None
    # How rounds reach the workers (``--download-codec``), the published parameters' checksum
    # (None until computed for this round), and downloads sent: full parameters (the model or
    # a fragment) and a lossy downlink's update bodies. Defaults, as above.
    download_codec: str = "fp32"
    checksum: str | None = None
    full_downloads: int = 0
    update_downloads: int = 0
    # All-reduce mode (server/allreduce/quorum_book.py): the open quorum, quorums that completed a
    # round or were discarded, workers waiting for a quorum. Defaults, as above.
    quorum: QuorumStatus | None = None
    rounds_completed: int = 0
    rounds_discarded: int = 0
    pending_quorum: tuple[str, ...] = ()
    left_out: tuple[LeftOutStatus, ...] = ()  # and why (server/allreduce/suspects.py)
    # The members the checks left out of a quorum's average: the last quorum's that left any
    # out, and per worker (worker/allreduce/average_checks.py). Defaults, as above.
    excluded_last: tuple[str, ...] = ()
    excluded_rounds: tuple[WorkerExclusions, ...] = ()
    # The run's pace (server/members/rates.py): inner steps per second of the live workers
    # together (None: none known yet) and bytes per second both ways over the last seconds;
    # uploads counted (each fragment's); Delayed Nesterov's arrivals in the open buffer, one
    # per outer optimizer (per fragment). Defaults, as above.
    steps_per_second: float | None = None
    bytes_per_second: float | None = None
    submissions: int = 0
    dn_buffered: tuple[int, ...] = ()
    # The outer rule (``--outer-rule``: ``sgd`` or ``sparseloco``, core/outer_rules.py).
    # A default, as above.
    outer_rule: str = "sgd"
    # Swarm mode (server/swarm/): stages, replicas, throughput, boundary bytes, reroutes and
    # suspects; None (left out of the JSON) in the other modes.
    swarm: SwarmStatus | None = field(default=None, metadata={OMIT: True})
    # A regional relay's upstream (server/relay/); None (left out of the JSON) elsewhere.
    upstream: UpstreamStatus | None = field(default=None, metadata={OMIT: True})
    # Sync quorum rounds (server/rounds/quorum.py): the rule, the open round's quorum and grace
    # window, the last late merges; None (left out of the JSON) without --quorum.
    quorum_rounds: QuorumRounds | None = field(default=None, metadata={OMIT: True})

    def to_json(self) -> dict[str, Any]:
        """The JSON-able dict of ``GET /status``."""
        out = to_json(self)
        assert isinstance(out, dict)
        return out

    @classmethod
    def from_json(cls, data: object) -> Status:
        """Parse a /status document. Raises ``StatusFormatError`` when a field is missing (or
        renamed); unknown extra keys are ignored, so a newer server that adds fields still
        parses. Values are taken as they come (their types are not checked)."""
        return from_json(cls, data, "status")


# What ``build_status`` reads, as protocols: the fronts and their parts satisfy them without
# this module importing them (they import its records).


class _Log(Protocol):
    started_at: float
    bytes_in: int
    bytes_out: int
    rejected: int
    refused_updates: int
    last_refusal: Refusal | None
    last_round_contributions: int
    update_log: deque[UpdateEntry]
    staleness_log: deque[int]
    staleness_total: int
    staleness_count: int
    gated: int
    full_downloads: int
    update_downloads: int
    submissions: int
    traffic: Rate


class _Losses(Protocol):
    def entries(self, since: int, started_at: float) -> tuple[RoundLoss, ...]: ...


class _Aggregator(Protocol):
    def public(self) -> State: ...


class _Unit(Protocol):
    @property
    def index(self) -> int: ...
    @property
    def round(self) -> int: ...
    @property
    def published_round(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def aggregator(self) -> _Aggregator: ...


class Observed(Protocol):
    """The server state a status is built from (either front is one)."""

    @property
    def config(self) -> ServerConfig: ...
    @property
    def clock(self) -> Callable[[], float]: ...
    @property
    def mode(self) -> str: ...
    @property
    def registry(self) -> WorkerRegistry: ...
    @property
    def run_log(self) -> _Log: ...
    @property
    def loss_history(self) -> _Losses: ...
    @property
    def store(self) -> ParamStore | None: ...
    @property
    def units(self) -> Sequence[_Unit]: ...
    @property
    def fragmenting(self) -> tuple[int, str] | None: ...
    @property
    def num_workers(self) -> int: ...
    @property
    def uploads_waiting(self) -> int: ...
    def shown_round(self) -> int: ...
    def outer_optimizers(self) -> Sequence[torch.optim.Optimizer]: ...
    def saves(self) -> Saves: ...
    def quorum_state(self) -> QuorumSummary: ...


def build_status(coord: Observed, history_since: int = 0) -> Status:
    """The one place that reads the server's state for display; ``loss_history`` from round
    ``history_since`` on."""
    config, store, units = coord.config, coord.store, coord.units
    run_log, saves = coord.run_log, coord.saves()
    uptime_s = round(coord.clock() - run_log.started_at, 3)  # before the workers' clock reading
    optimizers = coord.outer_optimizers()
    states = [u.aggregator.public() for u in units]
    barrier = next((s for s in states if s.opened is not None), None)  # the first sync unit
    recent = list(run_log.staleness_log)
    log = list(run_log.update_log)
    last = log[-1] if log else None
    ar = coord.quorum_state()
    workers = _workers(coord)
    speeds = [w.steps_per_second for w in workers if w.steps_per_second is not None]
    traffic = run_log.traffic.rate(coord.clock())
    return Status(
        mode=coord.mode,
        instance=store.instance if store else ar.instance,
        uptime_s=uptime_s,
        round=coord.shown_round(),
        opened=bool(barrier.opened)
        if barrier
        else (config.mode == "async" and bool(units)) or ar.quorum is not None,
        num_workers=barrier.num_workers or 0 if barrier else coord.num_workers,
        min_workers=barrier.min_workers or 0 if barrier else config.min_workers,
        expected=barrier.expected if barrier else (),
        submitted=barrier.submitted or () if barrier else (),
        uploading=(
            barrier.uploading
            if barrier
            else tuple(sorted({w for s in states for w in s.uploading}))
        ),
        closing=bool(barrier.closing) if barrier else False,
        updates=store.round if store else 0,
        fragments=(
            tuple(_fragment(u, st) for u, st in zip(units, states, strict=True))
            if len(units) > 1
            else None
        ),
        fragment_pattern=coord.fragmenting[1] if coord.fragmenting else None,
        has_params=store is not None,
        num_params=store.numel if store else ar.num_params,
        model_bytes=store.nbytes if store else 0,
        copies_on_write=store.copies_on_write if store else 0,
        outer_optimizer=OuterOptimizer(**optimizer_hparams(optimizers[0])) if optimizers else None,
        outer_optimizer_class=type(optimizers[0]).__name__ if optimizers else None,
        delayed_nesterov=(
            DelayedNesterovSettings(
                config.dn_buffer_size or config.num_workers, config.dn_activation
            )
            if config.delayed_nesterov
            else None
        ),
        weighting=config.weighting,
        staleness_weighting=config.staleness_weighting,
        staleness_cutoff=config.staleness_cutoff,
        max_staleness=config.max_staleness,
        staleness=Staleness(
            last=recent[-1] if recent else None,
            mean=round(run_log.staleness_total / run_log.staleness_count, 4)
            if run_log.staleness_count
            else None,
            max=max(recent) if recent else None,
            count=run_log.staleness_count,
            gated=run_log.gated,
        ),
        dylu=config.dylu,
        bytes_in=run_log.bytes_in,
        bytes_out=run_log.bytes_out,
        rejected_submissions=run_log.rejected,
        kicks=coord.registry.kicks,
        refused_updates=run_log.refused_updates,
        last_refusal=run_log.last_refusal,
        robust_aggregation=(
            RobustAggregation(config.clip_norm_factor, config.trim_fraction)
            if config.robust
            else None
        ),
        last_round_contributions=run_log.last_round_contributions,
        last_round_time_s=last.round_time_s if last else None,
        upload_slots=config.upload_slots,
        uploads_waiting=coord.uploads_waiting,
        last_round_upload_wait_max_s=last.upload_wait_max_s if last else None,
        update_log=tuple(
            replace(e, t=round(e.t - run_log.started_at, 4)) for e in log[-STATUS_LOG:]
        ),
        registrations=coord.registry.registrations,
        worker_deaths=coord.registry.deaths,
        heartbeat_timeout=config.heartbeat_timeout,
        stuck_timeout=config.stuck_timeout,
        join_timeout=config.join_timeout,
        save_dir=config.save_dir,
        last_save=saves.last_save,
        last_save_error=saves.last_save_error,
        resumed_from=saves.resumed_from,
        workers=workers,
        loss_history=coord.loss_history.entries(history_since, run_log.started_at),
        codecs=tuple(sorted({w.codec for w in coord.registry if w.codec is not None})),
        allowed_codecs=config.allowed_codecs,
        last_round_bytes_in=last.round_bytes_in if last else None,
        last_round_bytes_out=last.round_bytes_out if last else None,
        download_codec=config.download_codec,
        checksum=store.checksum if store else None,
        full_downloads=run_log.full_downloads,
        update_downloads=run_log.update_downloads,
        quorum=ar.quorum,
        rounds_completed=ar.rounds_completed,
        rounds_discarded=ar.rounds_discarded,
        pending_quorum=ar.pending_quorum,
        left_out=ar.left_out,
        excluded_last=ar.excluded_last,
        excluded_rounds=ar.excluded_rounds,
        steps_per_second=round(sum(speeds), 4) if speeds else None,
        bytes_per_second=round(traffic, 1) if traffic is not None else None,
        submissions=run_log.submissions,
        dn_buffered=tuple(o.buffered() for o in optimizers if isinstance(o, DelayedNesterov)),
        outer_rule=config.outer_rule,
        quorum_rounds=barrier.quorum_rounds if barrier else None,
    )


def _fragment(unit: _Unit, state: State) -> FragmentStatus:
    return FragmentStatus(
        fragment=unit.index,
        round=unit.round,
        published_round=unit.published_round,
        num_params=unit.nbytes // F32_BYTES,
        submitted=state.submitted,
        uploading=state.uploading,
        closing=state.closing,
    )


def _workers(coord: Observed) -> tuple[WorkerStatus, ...]:
    now = coord.clock()
    return tuple(
        WorkerStatus(
            worker_id=w.worker_id,
            hostname=w.hostname,
            registered_s_ago=round(now - w.registered_at, 3),
            last_seen_s_ago=round(now - w.last_seen, 3),
            steps_per_second=coord.registry.speed(w),
            loss=w.loss,
            submissions=w.submissions,
            last_round=w.last_round,
            bytes_in=w.bytes_in,
            bytes_out=w.bytes_out,
            step_age_s=w.step_age_s,
            syncing=w.syncing,
            smoothed_speed=w.smoothed_speed,
            recommended_sync_every=w.recommended_sync_every,
            staleness=w.staleness,
            codec=w.codec,
            sync_every=w.info.sync_every,
            region=w.info.region,
        )
        for w in coord.registry
    )
