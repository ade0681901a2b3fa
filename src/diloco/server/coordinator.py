"""DiLoCo on the server: registry, units (the whole model or its fragments), rounds or
asynchronous updates, outer steps, checkpoints.

Everything here runs on the server's event loop thread, so barrier and registry state need no
locks. Tensor work (adding an upload to a sum, an outer step) runs in worker threads; the
``_tensor_lock`` orders it. No lock is held while bytes travel on a socket, with one exception:
the round's first upload owns its unit's sum while it arrives (server/first_write.py), and an add
queued on the lock behind it waits for it.

Modes (``ServerConfig.mode``): ``sync`` closes a round per unit when its expected workers have
submitted (docs/design.md, "Sync barrier"); ``async`` applies every submission as it arrives,
recording its staleness. Both work per unit, so streaming fragments advance independently.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from diloco.core import (
    default_outer_optimizer,
    optimizer_hparams,
    set_optimizer_hparams,
)
from diloco.core.delayed_nesterov import DelayedNesterov
from diloco.core.dylu import recommended_sync_every, smooth_speed
from diloco.core.finite import FiniteGuard
from diloco.core.fragments import PATTERNS, SEQUENTIAL
from diloco.core.outer import PieceDone
from diloco.core.robust import robust_mean
from diloco.core.staleness import inverse_sqrt_weight
from diloco.server.async_gate import AsyncCheck
from diloco.server.barrier import Admission, Check, SyncBarrier, Verdict
from diloco.server.config import ServerConfig
from diloco.server.errors import ApiError, bad_request, conflict, unknown_worker
from diloco.server.first_write import FirstWrite, Stages
from diloco.server.params import ParamStore, Snapshot
from diloco.server.persistence import Checkpoint, save_checkpoint
from diloco.server.registry import WorkerInfo, WorkerRegistry
from diloco.server.status import Refusal, SaveRecord, UpdateEntry, build_status
from diloco.server.units import Unit, plan_pieces
from diloco.server.upload_slots import SlotPool
from diloco.wire import (
    Layout,
    PayloadReader,
    WireError,
    aread_payload,
    byte_view,
    check_against,
    tensor_views,
)
from diloco.wire.decode import AsyncStream

log = logging.getLogger(__name__)

OptimizerFactory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]
UPLOAD_DTYPES = ("F32", "BF16")
REFUSED_TOLD = 8  # refused rounds named in upload replies (a worker syncs at least once between)
UPDATE_LOG = 2048  # outer updates remembered for status and metrics
# A round whose longest upload wait for a receive buffer passes both of these gets a hint in the
# log (once per run): the uploads then queue enough to matter.
HINT_WAIT_S = 1.0
HINT_WAIT_SHARE = 0.25
# Bounds of a reported weight (weighting='samples'). A weight multiplies an fp32 upload and the
# sum of weights divides the sum: 1e39 is a finite Python float but infinite in fp32, and
# denormal weights make the total ~0. Within these bounds every weight and any total of them is
# a normal fp32 number, which covers any count of samples or tokens one round can see
# (1e12 tokens per worker per round is far past any real run), fractions included.
MIN_WEIGHT = 1e-6
MAX_WEIGHT = 1e12


def _meta_int(meta: dict[str, str], key: str) -> int:
    try:
        return int(meta[key])
    except KeyError:
        raise bad_request("missing_metadata", f"header __metadata__ lacks {key!r}") from None
    except ValueError:
        raise bad_request("bad_metadata", f"__metadata__[{key!r}] must be an integer") from None


def _meta_weight(meta: dict[str, str]) -> float:
    raw = meta.get("weight", "1")
    try:
        weight = float(raw)
    except ValueError:
        raise bad_request(
            "bad_metadata", f"__metadata__['weight'] must be a number, got {raw!r}"
        ) from None
    if not MIN_WEIGHT <= weight <= MAX_WEIGHT:  # also NaN
        raise bad_request(
            "bad_metadata",
            f"__metadata__['weight'] must be a number in [{MIN_WEIGHT:g}, {MAX_WEIGHT:g}] "
            f"(a count of samples or tokens), got {raw!r}",
        )
    return weight


class Coordinator:
    """The server's state machine. Sync or async, one unit or one per fragment."""

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
        #: Workers round 0 waits for; an operator may change it (config is frozen).
        self.num_workers = config.num_workers
        self._factory = optimizer_factory or self._default_optimizer
        self.store: ParamStore | None = None
        self.units: list[Unit] = []
        #: (number of fragments, pattern): from the config, a checkpoint, or the first worker.
        self.fragmenting: tuple[int, str] | None = None
        if config.num_fragments is not None:
            self.fragmenting = (config.num_fragments, config.fragment_pattern or SEQUENTIAL)
        self._restored: Checkpoint | None = None
        self._tensor_lock = asyncio.Lock()
        self._pool: SlotPool | None = None
        self._initializing = False
        self.last_save: SaveRecord | None = None
        self.resumed_from: str | None = None
        #: When a run that had closed rounds was resumed, until its round opens (see
        #: _open_resumed_rounds).
        self._resumed_at: float | None = None
        self.last_round_contributions = 0
        self.last_save_error: str | None = None
        self.started_at = clock()
        self.bytes_in = 0
        self.bytes_out = 0
        self.rejected = 0
        self.kicks = 0
        #: Rounds (sync) or updates (async) refused because their result would not be finite.
        self.refused_updates = 0
        self.last_refusal: Refusal | None = None
        #: Per unit, the latest refused rounds: told in upload replies, so a worker whose upload
        #: one of them discarded counts those steps as dropped.
        self._refused_rounds: dict[int, deque[int]] = {}
        #: Per unit: the guard of its outer steps (core/finite.py), made at its first step.
        self._guards: dict[int, FiniteGuard] = {}
        #: Per unit, with robust aggregation: the open round's uploads (weight, fp32 tensors).
        self._kept: dict[int, list[tuple[float, list[torch.Tensor]]]] = {}
        #: Recent outer updates (sync: rounds; async: applied submissions), newest last.
        self.update_log: deque[UpdateEntry] = deque(maxlen=UPDATE_LOG)
        self.staleness_log: deque[int] = deque(maxlen=UPDATE_LOG)
        self.staleness_total = 0
        self.staleness_count = 0
        self._closing_tasks: set[asyncio.Task[None]] = set()
        #: Per unit: seconds each upload toward its open round waited for a receive buffer.
        self._upload_waits: dict[int, list[float]] = {}
        self._slots_hinted = False
        self._stages = Stages()
        #: Per unit: the first write in progress, and adds recorded but not yet finished.
        self._first_writes: dict[int, FirstWrite] = {}
        self._adds_pending: dict[int, int] = {}
        if store is not None:
            self._adopt_store(store)

    def _default_optimizer(self, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        config = self.config
        if config.delayed_nesterov:
            return DelayedNesterov(
                params,
                lr=config.outer_lr,
                momentum=config.outer_momentum,
                buffer_size=config.dn_buffer_size or config.num_workers,
                activation=config.dn_activation,
            )
        return default_outer_optimizer(
            params, config.outer_lr, config.outer_momentum, config.nesterov
        )

    # --- parameters and units -------------------------------------------------------------------

    def _adopt_store(self, store: ParamStore) -> None:
        self.store = store
        store.on_new_buffer = self._repoint
        if self.fragmenting is not None:
            self._build_units()

    def _repoint(self) -> None:
        for unit in self.units:
            unit.repoint()

    def _header_meta(self) -> dict[str, str]:
        """Full downloads tell a streaming worker the round of every fragment they hold."""
        return {"fragment_rounds": ",".join(str(u.published_round) for u in self.units)}

    def _build_units(self) -> None:
        """Split the model into units once both the parameters and the fragmenting are known."""
        store, fragmenting = self.store, self.fragmenting
        assert store is not None and fragmenting is not None and not self.units
        num, pattern = fragmenting
        plans = plan_pieces(store, num, pattern)
        ckpt = self._restored
        rounds = [store.round] if num == 1 else [0] * num
        if ckpt is not None:
            rounds = [int(r) for r in ckpt.extra.get("unit_rounds", [ckpt.round])]
            if len(rounds) != num:
                raise ValueError(f"{ckpt.path}: unit_rounds has {len(rounds)} entries, not {num}")
        self.units = [
            Unit(
                i,
                pieces,
                store,
                self._factory,
                mode=self.config.mode,
                round=rounds[i],
                num_workers=self.num_workers,
                min_workers=self.config.min_workers,
                max_staleness=self.config.max_staleness,
            )
            for i, pieces in enumerate(plans)
        ]
        if ckpt is not None:
            self._load_unit_state(ckpt)
            self._restored = None
        self._pool = SlotPool(
            max(u.nbytes for u in self.units), self.config.upload_slots, clock=self.clock
        )
        store.header_meta = self._header_meta if num > 1 else None
        store.refresh_header()
        live = self.registry.ids()
        for unit in self.units:
            if unit.barrier is not None:
                unit.barrier.on_register(live)
        log.info(
            "%s mode, %d unit(s) (%s): %s elements each",
            self.config.mode,
            num,
            pattern,
            "/".join(str(u.nbytes // 4) for u in self.units),
        )

    def require_units(self) -> list[Unit]:
        self.require_store()
        if not self.units:
            raise ApiError(
                503, "not_ready", "no worker has registered yet, so the fragments are not planned"
            )
        return self.units

    @property
    def barrier(self) -> SyncBarrier | None:
        """The whole model's barrier (sync mode with one unit); None otherwise."""
        return self.units[0].barrier if len(self.units) == 1 else None

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The whole model's outer optimizer (one unit); None otherwise."""
        return self.units[0].optimizer if len(self.units) == 1 else None

    # --- checkpoints ----------------------------------------------------------------------------

    def restore(self, ckpt: Checkpoint) -> None:
        """Resume from a checkpoint: parameters, each unit's round and outer optimizer state,
        counters, receipts. A checkpoint of another mode or fragmenting is refused: its
        optimizer state would not fit."""
        order = ckpt.extra.get("param_order") or list(ckpt.params)
        if sorted(order) != sorted(ckpt.params):
            raise ValueError(f"{ckpt.path}: param_order does not match the saved parameters")
        mode = ckpt.extra.get("mode", "sync")
        if mode != self.config.mode:
            raise ValueError(
                f"{ckpt.path} was saved in {mode} mode; start the server in {mode} mode, "
                "or without this save dir"
            )
        num, pattern = ckpt.extra.get("fragments", [1, SEQUENTIAL])
        saved = (int(num), str(pattern))
        if self.fragmenting is not None and self.fragmenting[0] != saved[0]:
            raise ValueError(
                f"{ckpt.path} holds {saved[0]} fragment(s), the server was asked for "
                f"{self.fragmenting[0]}"
            )
        self.fragmenting = saved
        self._restored = ckpt
        store = ParamStore.from_tensors({n: ckpt.params[n] for n in order}, round=ckpt.round)
        self._adopt_store(store)
        self.registry.deaths = int(ckpt.extra.get("worker_deaths", 0))
        self.resumed_from = str(ckpt.path)
        if ckpt.round > 0:
            self._resumed_at = self.clock()
        log.info("resumed from %s at round %d", ckpt.path, ckpt.round)

    def _load_unit_state(self, ckpt: Checkpoint) -> None:
        saved_class = ckpt.extra.get("outer_optimizer")
        ours = type(self.units[0].optimizer).__name__
        if saved_class is not None and saved_class != ours:
            raise ValueError(
                f"{ckpt.path} holds {saved_class} state; this server's outer optimizer is {ours}"
            )
        states = _split_states(ckpt.optimizer_state, ckpt.extra.get("optimizer_units"))
        if len(states) != len(self.units):
            raise ValueError(
                f"{ckpt.path}: optimizer state for {len(states)} units, not {len(self.units)}"
            )
        for unit, state in zip(self.units, states, strict=True):
            unit.optimizer.load_state_dict(state)
        for entry in ckpt.extra.get("receipts", []):
            sid, counted_in = entry[0], int(entry[1])
            index = int(entry[2]) if len(entry) > 2 else 0
            self.units[index].history[str(sid)] = counted_in

    def _write_checkpoint(self, store_round: int, unit_rounds: list[int]) -> Path:
        """Blocking: write the parameters and every unit's state as of ``unit_rounds``. The
        caller holds the tensor lock (nothing changes them mid-write) and runs this off the
        event loop."""
        assert self.config.save_dir is not None and self.store is not None and self.units
        store = self.store
        assert self.fragmenting is not None
        receipts = [
            [sid, r, unit.index]
            for unit, upto in zip(self.units, unit_rounds, strict=True)
            # Receipts of rounds (versions) whose result is inside these parameters.
            for sid, r in list(unit.history.items())
            if r < upto
        ]
        merged, shape = _merge_states([u.optimizer for u in self.units])
        extra = {
            "param_order": [s.name for s in store.specs],
            "mode": self.config.mode,
            "fragments": list(self.fragmenting),
            "unit_rounds": unit_rounds,
            "optimizer_units": shape,
            "outer_optimizer": type(self.units[0].optimizer).__name__,
            "receipts": receipts,
            "worker_deaths": self.registry.deaths,
            "instance": store.instance,
        }
        path = save_checkpoint(
            self.config.save_dir,
            store_round,
            store.named(),
            merged,
            extra,
            self.config.keep_checkpoints,
        )
        self.last_save = SaveRecord(store_round, str(path))
        log.info("saved round %d to %s", store_round, path)
        return path

    async def save(self) -> Path | None:
        """Write a checkpoint now (off the event loop). None when saving is not configured or
        there is nothing to save yet.

        The tensor lock keeps outer steps from changing parameters or momentum mid-write;
        uploads being received and downloads go on meanwhile."""
        if self.config.save_dir is None or self.store is None or not self.units:
            return None
        async with self._tensor_lock:
            store = self.require_store()
            rounds = [u.published_round for u in self.units]
            return await asyncio.to_thread(self._write_checkpoint, store.round, rounds)

    def require_store(self) -> ParamStore:
        if self.store is None:
            raise ApiError(
                503,
                "no_parameters",
                "the server has no parameters yet; a worker must upload initial parameters",
            )
        return self.store

    async def receive_initial(
        self, layout: Layout, stream: AsyncStream, worker_id: str
    ) -> dict[str, Any]:
        """The first worker provides the initial parameters when the server was started without."""
        if worker_id not in self.registry:
            raise unknown_worker(worker_id)
        if self.store is not None:
            raise conflict(
                "already_initialized", "the server already has parameters; download them instead"
            )
        if layout.total_size > self.config.max_initial_bytes:
            raise ApiError(
                413, "body_too_large", f"{layout.total_size} bytes exceed max_initial_bytes"
            )
        for spec in layout.specs:
            if spec.dtype not in ("F32", "BF16", "F16"):
                raise WireError(
                    "bad_dtype", f"parameter {spec.name!r} must be floating point, got {spec.dtype}"
                )
        if not layout.specs:
            raise bad_request("empty", "the initial parameters hold no tensor")
        if self._initializing:
            raise conflict(
                "already_initialized", "another worker is uploading the initial parameters"
            )
        self._initializing = True  # claimed before the first await: one upload wins the race
        uploader = self.registry.begin_transfer(worker_id)
        try:
            payload = torch.empty(layout.payload_size, dtype=torch.uint8)
            await aread_payload(stream, byte_view(payload))
            tensors = tensor_views(layout, payload)
            bad = await asyncio.to_thread(_first_non_finite, tensors)
            if bad is not None:
                raise ApiError(
                    422, "non_finite", f"initial parameter {bad!r} has NaN or infinite values"
                )
            store = await asyncio.to_thread(ParamStore.from_tensors, tensors)
            if self.fragmenting is not None:
                plan_pieces(store, *self.fragmenting)  # refuse a model that cannot be split
        except ValueError as exc:
            raise bad_request("bad_fragments", str(exc)) from None
        finally:
            self._initializing = False
            self.registry.end_transfer(uploader)
        self._adopt_store(store)
        self.bytes_in += layout.total_size
        log.info(
            "initial parameters from worker %s: %d tensors, %d parameters",
            worker_id,
            len(store.specs),
            store.numel,
        )
        return {"status": "ok", "round": store.round, "num_params": store.numel, **self._plan()}

    def _plan(self) -> dict[str, Any]:
        """The fragments a streaming worker must use: for each, ``[wire name, parameter, start,
        stop]`` per piece (None in plain DiLoCo), and each fragment's round."""
        if len(self.units) <= 1:
            return {"fragments": None, "fragment_rounds": None}
        return {
            "fragments": [
                [[p.wire_name, p.param, p.start, p.stop] for p in unit.pieces]
                for unit in self.units
            ],
            "fragment_rounds": [u.published_round for u in self.units],
        }

    # --- membership -----------------------------------------------------------------------------

    def _asked_fragmenting(self, info: dict[str, Any]) -> tuple[int, str]:
        num = info.get("num_fragments", 1)
        pattern = info.get("fragment_pattern", SEQUENTIAL)
        if isinstance(num, bool) or not isinstance(num, int) or num < 1:
            raise bad_request("bad_field", "info.num_fragments must be an integer >= 1")
        if pattern not in PATTERNS:
            raise bad_request("bad_field", f"info.fragment_pattern must be one of {PATTERNS}")
        return num, str(pattern)

    def _check_fragmenting(self, asked: tuple[int, str]) -> None:
        have = self.fragmenting
        if have is None:
            return
        if asked[0] != have[0] or (have[0] > 1 and asked[1] != have[1]):
            raise conflict(
                "fragments_mismatch",
                f"this run syncs in {have[0]} fragment(s) ({have[1]}); the worker asks for "
                f"{asked[0]} ({asked[1]}). Start it with num_fragments={have[0]}"
                + (f" and fragment_pattern={have[1]!r}" if have[0] > 1 else ""),
                action="reconfigure",
                fragments=have[0],
                fragment_pattern=have[1],
            )

    def register(
        self, worker_id: str | None, hostname: str, info: dict[str, Any]
    ) -> dict[str, Any]:
        asked = self._asked_fragmenting(info)
        self._check_fragmenting(asked)
        if self.fragmenting is None and self.store is not None:
            try:
                plan_pieces(self.store, *asked)
            except ValueError as exc:
                raise bad_request("bad_fragments", str(exc)) from None
        # Validated: from here on the registration changes state.
        worker_id = worker_id or f"w-{uuid.uuid4().hex[:10]}"
        record, new = self.registry.add(worker_id, hostname, info)
        if self.fragmenting is None:
            self.fragmenting = asked
            log.info("fragmenting %s set by worker %s", asked, worker_id)
        if self.store is not None and not self.units:
            self._build_units()
        for unit in self.units:
            if unit.barrier is not None:
                unit.barrier.on_register(self.registry.ids())
        log.info(
            "worker %s %s from %s (round %d)",
            worker_id,
            "registered" if new else "re-registered",
            hostname,
            self._round(),
        )
        self._maybe_close()
        reply: dict[str, Any] = {
            "worker_id": worker_id,
            "round": self._round(),
            "mode": self.config.mode,
            "instance": self.store.instance if self.store else None,
            "has_params": self.store is not None,
            "num_workers": self._num_workers(),
            "poll_timeout": self.config.poll_timeout,
            **self._plan(),
        }
        recommended = self._recommend(record)
        if recommended is not None:
            reply["recommended_sync_every"] = recommended
        last = info.get("last_submission_id")
        if isinstance(last, str) and last:
            # A worker that lost its connection asks whether its last upload was counted in an
            # update whose result is in our parameters; if not it keeps that progress (rebases).
            counted, in_params = None, False
            for unit in self.units:
                if last in unit.history:
                    counted = unit.history[last]
                    in_params = counted < unit.published_round
            reply["last_submission"] = {"counted_in": counted, "in_params": in_params}
        if self.store is not None:
            reply["params"] = [[s.name, list(s.shape)] for s in self.store.specs]
        return reply

    def _round(self) -> int:
        """The round to show: the whole model's (one unit) or the store's update count."""
        if len(self.units) == 1:
            return self.units[0].round
        return self.store.round if self.store is not None else 0

    def _num_workers(self) -> int:
        barriers = [u.barrier for u in self.units if u.barrier is not None]
        return barriers[0].num_workers if barriers else self.num_workers

    def deregister(self, worker_id: str, *, died: bool = False) -> dict[str, Any]:
        if self.registry.remove(worker_id, died=died) is None:
            raise unknown_worker(worker_id)
        for unit in self.units:
            if unit.barrier is not None:
                unit.barrier.on_leave(worker_id)
            else:
                assert unit.gate is not None
                unit.gate.on_leave(worker_id)
        log.info("worker %s %s (round %d)", worker_id, "evicted" if died else "left", self._round())
        self._maybe_close()
        return {"status": "ok", "round": self._round()}

    def heartbeat(self, worker_id: str, body: dict[str, Any]) -> dict[str, Any]:
        if worker_id not in self.registry:
            raise unknown_worker(worker_id)
        updates: dict[str, Any] = {}
        if "syncing" in body:
            if not isinstance(body["syncing"], bool):
                raise bad_request("bad_field", "syncing must be a boolean")
            updates["syncing"] = body["syncing"]
        for key in ("steps_per_second", "loss", "step_age_s"):
            value = body.get(key)
            if value is not None:
                if (
                    isinstance(value, bool)
                    or not isinstance(value, (int, float))
                    or not math.isfinite(value)
                ):
                    raise bad_request("bad_field", f"{key} must be a finite number")
                updates[key] = float(value)
        record = self.registry.touch(worker_id)  # validated first: a bad request changes nothing
        assert record is not None
        for key, value in updates.items():
            setattr(record, key, value)
        # A worker that spent the interval syncing reports no speed (or 0): the smoothed speed
        # keeps its previous value instead of collapsing, so DyLU does not flap.
        record.smoothed_speed = smooth_speed(record.smoothed_speed, updates.get("steps_per_second"))
        reply: dict[str, Any] = {"status": "ok", "round": self._round()}
        recommended = self._recommend(record)
        if recommended is not None:
            reply["recommended_sync_every"] = recommended
        return reply

    def _recommend(self, record: WorkerInfo) -> int | None:
        """DyLU: this worker's sync_every from its smoothed speed relative to the fastest."""
        if not self.config.dylu:
            return None
        base = record.info.get("sync_every")
        if isinstance(base, bool) or not isinstance(base, int) or base < 1:
            return None
        speeds = {w.worker_id: w.smoothed_speed for w in self.registry}
        value = recommended_sync_every(speeds, base, self.config.dylu_min_sync_every)
        record.recommended_sync_every = value[record.worker_id]
        return record.recommended_sync_every

    def check_health(self) -> list[str]:
        """Evict silent and stuck workers, and ghosts (registered, never joined); returns their
        ids. Called periodically, and directly by tests with a fake clock."""
        evicted = []
        reasons = {}
        if self.config.join_timeout > 0:
            reasons.update(
                {
                    w: f"no download, heartbeat or upload within {self.config.join_timeout:g} s "
                    "of registering (join_timeout): it failed while joining"
                    for w in self.registry.unjoined(self.config.join_timeout)
                }
            )
        if self.config.heartbeat_timeout > 0:
            reasons.update(
                {w: "silent" for w in self.registry.silent(self.config.heartbeat_timeout)}
            )
        if self.config.stuck_timeout > 0:
            reasons.update({w: "stuck" for w in self.registry.stuck(self.config.stuck_timeout)})
        for worker_id, why in reasons.items():
            log.warning("evicting worker %s: %s (round %d)", worker_id, why, self._round())
            self.deregister(worker_id, died=True)
            evicted.append(worker_id)
        self._open_resumed_rounds()
        return evicted

    def _open_resumed_rounds(self) -> None:
        """A resumed run's round waits for ``num_workers`` registrations, as round 0 does, but
        only for ``heartbeat_timeout``: a worker that has not re-registered by then is as gone
        as one that fell silent (it finished its loop, or died while the server was down), and
        waiting for it would hold the workers that did come back until their barrier wait ends.
        The round then opens with the workers here, if they are at least ``min_workers``."""
        resumed, grace = self._resumed_at, self.config.heartbeat_timeout
        if resumed is None or grace <= 0 or self.clock() - resumed < grace:
            return
        live = self.registry.ids()
        waiting = [u.barrier for u in self.units if u.barrier is not None and not u.barrier.opened]
        opened = [b for b in waiting if b.open_with(live)]
        if opened:
            log.warning(
                "round %d opened with %d of %d workers: the others did not re-register within "
                "%g s (heartbeat_timeout) of the restart",
                opened[0].round,
                len(live),
                opened[0].num_workers,
                grace,
            )
            self._maybe_close()
        if len(opened) == len(waiting):
            self._resumed_at = None

    async def health_loop(self) -> None:
        config = self.config
        deadlines = (config.heartbeat_timeout, config.stuck_timeout, config.join_timeout)
        timeouts = [t for t in deadlines if t > 0]
        if not timeouts:
            return
        interval = max(0.05, min(timeouts) / 4)
        while True:
            await asyncio.sleep(interval)
            self.check_health()

    # --- submissions ----------------------------------------------------------------------------

    def _unit_of(self, meta: dict[str, str]) -> Unit:
        units = self.require_units()
        raw = meta.get("fragment")
        if raw is None:
            if len(units) > 1:
                raise bad_request(
                    "missing_metadata",
                    f"this run syncs in {len(units)} fragments: __metadata__ needs 'fragment'",
                )
            return units[0]
        return units[self.fragment_index(raw)]

    def fragment_index(self, raw: str) -> int:
        """Validate a fragment number from a request."""
        units = self.require_units()
        try:
            index = int(raw)
        except ValueError:
            raise bad_request("bad_fragment", f"fragment must be an integer, got {raw!r}") from None
        if not 0 <= index < len(units):
            raise bad_request(
                "bad_fragment", f"fragment must be in [0, {len(units) - 1}], got {index}"
            )
        return index

    def _which(self, unit: Unit) -> dict[str, int]:
        """The ``fragment`` field of replies, present when the run streams fragments."""
        return {"fragment": unit.index} if len(self.units) > 1 else {}

    async def submit(self, layout: Layout, stream: AsyncStream) -> dict[str, Any]:
        self.require_store()
        meta = dict(layout.metadata)
        worker_id = meta.get("worker_id", "")
        submission_id = meta.get("submission_id", "")
        if not worker_id or not submission_id:
            raise bad_request(
                "missing_metadata", "header __metadata__ needs worker_id and submission_id"
            )
        base_round = _meta_int(meta, "base_round")
        weight = _meta_weight(meta) if self.config.weighting == "samples" else 1.0
        record = self.registry.get(worker_id)
        if record is None:
            raise unknown_worker(worker_id)
        unit = self._unit_of(meta)
        check_against(layout, unit.table, UPLOAD_DTYPES)
        duplicate = self._verdict(unit, worker_id, base_round, submission_id)
        if duplicate is not None:
            return duplicate
        assert self._pool is not None
        admission = unit.barrier if unit.barrier is not None else unit.gate
        assert admission is not None
        admission.begin_upload(worker_id, submission_id)
        reply: dict[str, Any]
        try:
            first = self._begin_first_write(unit, layout, weight, worker_id)
            if first is not None:
                self._upload_waits.setdefault(unit.index, []).append(0.0)
                try:
                    await first.run(PayloadReader(stream))
                    await self._check_current(unit, worker_id, submission_id, admission)
                    assert unit.barrier is not None
                    unit.barrier.record(worker_id, submission_id)
                    unit.sum.commit_first(weight)
                finally:
                    first.finish(lambda: self._first_writes.pop(unit.index, None))
                reply = {"status": "accepted", "round": base_round}
            else:
                reply = await self._receive_into_slot(
                    unit, record, layout, stream, admission, submission_id, base_round, weight
                )
        except BaseException:
            admission.abort_upload(worker_id, submission_id)
            self._maybe_close()
            raise
        self.registry.touch(worker_id)
        record.submissions += 1
        record.last_round = base_round
        record.bytes_in += layout.total_size
        self.bytes_in += layout.total_size
        self._maybe_close()
        reply.update(
            submission_id=submission_id, instance=self.require_store().instance, **self._which(unit)
        )
        refused = self._refused_rounds.get(unit.index)
        if refused:
            reply["refused_rounds"] = list(refused)
        return reply

    def _begin_first_write(
        self, unit: Unit, layout: Layout, weight: float, worker_id: str
    ) -> FirstWrite | None:
        """A first write for this upload if it may have the sum (sync, one unit, nothing counted
        or pending, no first write under way), else None (it goes through a slot)."""
        if (
            unit.barrier is None
            or len(self.units) != 1
            or unit.sum.count
            or self._adds_pending.get(unit.index, 0)
            or unit.index in self._first_writes
            or self.config.robust  # the round keeps each upload whole, not a running sum
        ):
            return None
        first = FirstWrite(unit.sum, unit.names, layout, weight, self._stages, worker_id)
        self._first_writes[unit.index] = first
        return first

    async def _sum_free(self, unit: Unit) -> None:
        """Wait until no first write owns ``unit``'s sum."""
        while (first := self._first_writes.get(unit.index)) is not None:
            await first.done.wait()

    def _keep(self, unit: Unit, tensors: list[torch.Tensor], weight: float) -> Callable[[], None]:
        """Robust aggregation: the add of one landed body is an fp32 copy kept for the round's
        close (the median of the norms and the trimmed mean need every upload at once). It runs
        under the tensor lock, as adds do, so a close queued after it sees it."""

        def keep() -> None:
            copies = [t.to(torch.float32, copy=True) for t in tensors]
            self._kept.setdefault(unit.index, []).append((weight, copies))

        return keep

    async def _receive_into_slot(
        self,
        unit: Unit,
        record: WorkerInfo,
        layout: Layout,
        stream: AsyncStream,
        admission: Admission,
        submission_id: str,
        base_round: int,
        weight: float,
    ) -> dict[str, Any]:
        """The ordinary path: the whole body into an upload slot, checked, then added to the
        sum (sync) or applied (async)."""
        assert self._pool is not None
        worker_id = record.worker_id
        async with self._pool.take() as lease:
            self._upload_waits.setdefault(unit.index, []).append(lease.waited_s)
            payload = lease.slot.buffer[: layout.payload_size]
            await aread_payload(stream, byte_view(payload), room=lease.slot.room)
            views = tensor_views(layout, payload)
            tensors = [views[n] for n in unit.names]
            if unit.barrier is None:  # async: the update reads the body under the lease
                await self._check_upload(unit, worker_id, submission_id, admission, tensors)
                return await self._apply_async(
                    unit, record, submission_id, base_round, tensors, layout.total_size
                )
            # The next upload may start filling this buffer behind the add.
            drain = await lease.hand_over()
            try:
                await self._check_upload(unit, worker_id, submission_id, admission, tensors)
                # From here on the submission counts: record it, then queue the addition on the
                # tensor lock before yielding, so a round close queued later sees it.
                unit.barrier.record(worker_id, submission_id)
                add = (
                    self._keep(unit, tensors, weight)
                    if self.config.robust
                    else _payload_order_add(unit, layout, tensors, weight, drain.report)
                )
                pending = self._adds_pending
                pending[unit.index] = pending.get(unit.index, 0) + 1
                try:
                    async with self._tensor_lock:
                        await self._sum_free(unit)
                        await drain.run(add)
                finally:
                    pending[unit.index] -= 1
            finally:
                drain.finish()
        return {"status": "accepted", "round": base_round}

    async def _check_upload(
        self,
        unit: Unit,
        worker_id: str,
        submission_id: str,
        admission: Admission,
        tensors: list[torch.Tensor],
    ) -> None:
        """What a landed body must pass before it counts: finite values, its worker still
        registered, and no newer upload of the same worker begun meanwhile."""
        bad = await asyncio.to_thread(
            _first_non_finite, dict(zip(unit.names, tensors, strict=True))
        )
        if bad is not None:
            raise ApiError(422, "non_finite", f"pseudo-gradient {bad!r} has NaN or infinite values")
        await self._check_current(unit, worker_id, submission_id, admission)

    async def _check_current(
        self, unit: Unit, worker_id: str, submission_id: str, admission: Admission
    ) -> None:
        """The worker of a landed body is still registered and began no newer upload."""
        if self.registry.get(worker_id) is None:
            raise unknown_worker(worker_id)  # evicted while uploading
        if admission.uploading.get(worker_id) != submission_id:
            # The worker left and came back while this body was in flight.
            raise conflict(
                "superseded",
                "this upload was superseded; rebase",
                action="rebase",
                round=unit.round,
                **self._which(unit),
            )

    async def _apply_async(
        self,
        unit: Unit,
        record: WorkerInfo,
        submission_id: str,
        base: int,
        tensors: list[torch.Tensor],
        nbytes: int,
    ) -> dict[str, Any]:
        """Apply one submission as the next update of ``unit``. The reply names the version it
        made; the worker downloads it (or a newer one) next."""
        gate = unit.gate
        assert gate is not None
        async with self._tensor_lock:
            t0 = self.clock()
            if gate.too_stale(base):
                # Other updates were applied while this body was on the wire.
                self.rejected += 1
                raise self._too_stale(unit, base, gate.staleness_now(base))
            stale = gate.staleness_now(base)
            applied_to = gate.record(record.worker_id, submission_id)
            weight = (
                inverse_sqrt_weight(stale)
                if self.config.staleness_weighting == "inverse_sqrt"
                else 1.0
            )

            guard = self._guard(unit)
            refused: list[str] = []

            def outer_step(progress: PieceDone | None) -> None:
                unit.sum.add(tensors, weight)
                why = guard.step(unit.sum.sums, on_piece=progress)
                if why is not None:
                    refused.append(why)
                unit.sum.reset()

            # A refused update still makes its version (the parameters unchanged), as a refused
            # sync round does: the gate has recorded the submission, and its worker waits for it.
            await self._publish_update(unit, applied_to + 1, outer_step, before=gate.advance)
            outer_s = self.clock() - t0
        record.staleness = stale
        self.staleness_log.append(stale)
        self.staleness_total += stale
        self.staleness_count += 1
        self.last_round_contributions = 1
        if refused:
            self._refuse(unit, applied_to, 1, refused[0])
        self._log_update(
            unit,
            applied_to,
            outer_s,
            1,
            nbytes,
            staleness=stale,
            weight=weight,
            refused=bool(refused),
        )
        reply: dict[str, Any] = {
            "status": "accepted",
            "round": applied_to,
            "version": applied_to + 1,
            "staleness": stale,
            "weight": weight,
        }
        if refused:
            reply["refused"] = refused[0]
        return reply

    async def _publish_update(
        self,
        unit: Unit,
        unit_round: int,
        outer_step: Callable[[PieceDone | None], None],
        before: Callable[[], None] | None = None,
    ) -> None:
        """Run ``outer_step`` on ``unit`` off the event loop (caller holds the tensor lock),
        write a periodic checkpoint if one is due, then publish: the unit's round becomes
        ``unit_round`` and the store's update count moves by one. ``before`` runs on the loop
        just before the unit's round moves (the barrier opens its next round there, the async
        gate advances its version), and so before any download of the new round can end.

        When the unit is the whole model, downloads of the new round start as the step begins
        and stream each part as soon as it is final: ``outer_step`` gets a progress callback to
        pass to ``apply_outer_step``."""
        store = self.require_store()
        new_round = store.round + 1
        rounds = [u.published_round for u in self.units]
        rounds[unit.index] = unit_round
        durable = self._durable(new_round)

        def step(progress: PieceDone | None) -> None:
            outer_step(progress)
            if durable:
                self._checkpoint_quietly(new_round, rounds)

        def publish() -> None:
            if before is not None:
                before()
            unit.published_round = unit_round

        # A round that is to be durable is not streamed while it is written: its first byte
        # leaves only once its checkpoint is on disk, so no worker drops progress for a result
        # a crash could take back (a worker adopts a streamed round as its bytes land).
        await store.update(
            step,
            new_round=new_round,
            on_publish=publish,
            stream=len(self.units) == 1 and not durable,
        )

    def _too_stale(self, unit: Unit, base: int, stale: int) -> ApiError:
        return conflict(
            Verdict.TOO_STALE.value,
            f"{stale} updates were applied since version {base}, more than "
            f"max_staleness={self.config.max_staleness}; rebase onto the current parameters",
            action="rebase",
            round=unit.round,
            staleness=stale,
            **self._which(unit),
        )

    def _durable(self, store_round: int) -> bool:
        every = self.config.save_every
        return self.config.save_dir is not None and every > 0 and store_round % every == 0

    def _checkpoint_quietly(self, store_round: int, unit_rounds: list[int]) -> None:
        """Written before the result is published: no worker ever adopts parameters a crash
        could take back, so no accepted contribution is lost with them. A full disk must not
        stop training."""
        try:
            self._write_checkpoint(store_round, unit_rounds)
        except OSError as exc:
            self.last_save_error = f"round {store_round}: {exc}"
            log.error("checkpoint of round %d failed: %s", store_round, exc)

    def _verdict(
        self, unit: Unit, worker_id: str, base_round: int, submission_id: str
    ) -> dict[str, Any] | None:
        """None to accept; the reply for a duplicate; raises 409 for everything else."""
        check: Check | AsyncCheck
        if unit.barrier is not None:
            check = unit.barrier.check(worker_id, base_round, submission_id)
            current = check.round
        else:
            assert unit.gate is not None
            check = unit.gate.check(worker_id, base_round, submission_id)
            current = check.version
        v = check.verdict
        if v is Verdict.ACCEPT:
            return None
        if v is Verdict.DUPLICATE:
            # Not an error: a retry of an upload that was already counted. Say where it went.
            reply: dict[str, Any] = {
                "status": "duplicate",
                "round": check.counted_in,
                "submission_id": submission_id,
                "instance": self.require_store().instance,
                **self._which(unit),
            }
            if unit.gate is not None and check.counted_in is not None:
                reply["version"] = check.counted_in + 1
            return reply
        self.rejected += 1
        if isinstance(check, AsyncCheck) and v is Verdict.TOO_STALE:
            raise self._too_stale(unit, base_round, check.staleness)
        details = {
            Verdict.STALE: f"computed against round {base_round}, the server is at round {current}; rebase onto the current parameters",
            Verdict.FUTURE: f"names round {base_round}, the server is at round {current}; rebase onto the current parameters",
            Verdict.NOT_EXPECTED: f"round {current} opened before this worker joined; keep training, it takes part from round {current + 1}",
            Verdict.ALREADY_SUBMITTED: f"this worker already contributed to round {current}; wait for its result",
            Verdict.IN_PROGRESS: "an upload from this worker is still being received; retry shortly",
            Verdict.CLOSING: f"round {current} is closing; rebase onto its result",
        }
        action = {
            Verdict.STALE: "rebase",
            Verdict.FUTURE: "rebase",
            Verdict.NOT_EXPECTED: "continue",
            Verdict.ALREADY_SUBMITTED: "wait",
            Verdict.IN_PROGRESS: "retry",
            Verdict.CLOSING: "rebase",
        }[v]
        raise conflict(v.value, details[v], round=current, action=action, **self._which(unit))

    # --- sync rounds ----------------------------------------------------------------------------

    def _maybe_close(self) -> None:
        if self.store is None:
            return
        for unit in self.units:
            if unit.barrier is not None and unit.barrier.ready():
                round_ = unit.barrier.begin_close()
                task = asyncio.get_running_loop().create_task(self._close(unit, round_))
                self._closing_tasks.add(task)
                task.add_done_callback(self._closing_tasks.discard)

    async def settle(self) -> None:
        """Wait for the outer steps under way (tests, shutdown)."""
        while self._closing_tasks:
            await asyncio.gather(*list(self._closing_tasks), return_exceptions=True)

    async def _close(self, unit: Unit, round_: int) -> None:
        try:
            await self._apply_round(unit, round_)
        except Exception:  # the round stays closing; nothing would make it succeed on retry
            log.exception("outer step of round %d (fragment %d) failed", round_, unit.index)
            raise

    async def _apply_round(self, unit: Unit, round_: int) -> None:
        wsum, barrier = unit.sum, unit.barrier
        assert barrier is not None
        async with self._tensor_lock:
            await self._sum_free(unit)  # a first write whose worker left mid-upload
            t0 = self.clock()
            count, total = wsum.count, wsum.total_weight
            kept = self._kept.pop(unit.index, []) if self.config.robust else []
            if kept:
                count, total = len(kept), sum(w for w, _ in kept)
            guard = self._guard(unit)
            refused: list[str] = []

            def outer_step(progress: PieceDone | None) -> None:
                divisor = total
                if kept:
                    self._robust_mean(unit, round_, kept)
                    divisor = 1.0
                # The weighted mean is the sum over the total weight: the step divides as it goes.
                # A step whose result would not be finite changes nothing (core/finite.py).
                why = guard.step(wsum.sums, divisor=divisor, on_piece=progress)
                if why is not None:
                    refused.append(why)
                wsum.reset()

            # A refused round still ends: it is published with the parameters unchanged, so the
            # workers waiting for round + 1 go on (docs/design.md, "Non-finite results").
            await self._publish_update(
                unit, round_ + 1, outer_step, before=lambda: barrier.advance(self.registry.ids())
            )
            outer_s = self.clock() - t0
        self.last_round_contributions = count
        if refused:
            self._refuse(unit, round_, count, refused[0])
        entry = self._log_update(unit, round_, outer_s, count, None, refused=bool(refused))
        self._hint_upload_slots(entry)
        log.info(
            "round %d%s closed: %d contributions (weight %.3g); round %d open",
            round_,
            f" of fragment {unit.index}" if len(self.units) > 1 else "",
            count,
            total,
            round_ + 1,
        )
        self._maybe_close()

    def _guard(self, unit: Unit) -> FiniteGuard:
        guard = self._guards.get(unit.index)
        if guard is None:
            guard = self._guards[unit.index] = FiniteGuard(unit.optimizer, unit.params)
        return guard

    def _robust_mean(
        self, unit: Unit, round_: int, kept: list[tuple[float, list[torch.Tensor]]]
    ) -> None:
        """Blocking: write the robust mean of the round's kept uploads into the unit's sum."""
        result = robust_mean(
            [t for _, t in kept],
            [w for w, _ in kept],
            unit.sum.sums,
            clip_factor=self.config.clip_norm_factor,
            trim_fraction=self.config.trim_fraction,
        )
        clipped = sum(s < 1 for s in result.scales)
        if clipped or result.trimmed:
            log.info(
                "round %d: %d of %d uploads clipped (norms %s), %d trimmed at each end",
                round_,
                clipped,
                len(kept),
                "/".join(f"{n:.3g}" for n in result.norms),
                result.trimmed,
            )

    def _refuse(self, unit: Unit, round_: int, contributions: int, why: str) -> None:
        self.refused_updates += 1
        self._refused_rounds.setdefault(unit.index, deque(maxlen=REFUSED_TOLD)).append(round_)
        self.last_refusal = Refusal(round_, unit.index, why)
        log.error(
            "%s %d%s refused: %s; its %d contribution(s) are discarded and the parameters and "
            "outer optimizer state stay as they were",
            "round" if unit.barrier is not None else "update",
            round_,
            f" of fragment {unit.index}" if len(self.units) > 1 else "",
            why,
            contributions,
        )

    def _log_update(
        self,
        unit: Unit,
        round_: int,
        outer_s: float,
        contributions: int,
        nbytes: int | None,
        *,
        refused: bool,
        staleness: int | None = None,
        weight: float | None = None,
    ) -> UpdateEntry:
        now = self.clock()
        since = now - (self.update_log[-1].t if self.update_log else self.started_at)
        waits = self._upload_waits.pop(unit.index, [])
        entry = UpdateEntry(
            round=round_,
            fragment=unit.index,
            t=now,  # shown relative to the start in a status
            round_time_s=round(since, 4),
            outer_step_s=round(outer_s, 4),
            contributions=contributions,
            bytes_in=self.bytes_in + (nbytes or 0),
            staleness=staleness,
            weight=weight,
            refused=refused,
            upload_wait_s=round(sum(waits), 4),
            upload_wait_max_s=round(max(waits, default=0.0), 4),
        )
        self.update_log.append(entry)
        return entry

    def _hint_upload_slots(self, entry: UpdateEntry) -> None:
        """Say once, when it first matters, that uploads queued for the receive buffers: with
        workers behind links slower than the server's, more slots let them arrive together."""
        longest, round_s = entry.upload_wait_max_s, entry.round_time_s
        if self._slots_hinted or longest < HINT_WAIT_S or longest < HINT_WAIT_SHARE * round_s:
            return
        self._slots_hinted = True
        assert self._pool is not None
        log.warning(
            "round %d: an upload waited %.1f s of the round's %.1f s for one of the %d upload "
            "buffer(s) (upload_slots); if workers reach this server over links slower than its "
            "own, more slots let their uploads arrive together, at up to %.0f MB of memory each "
            "(half that with bf16 uploads): diloco server --upload-slots N",
            entry.round,
            longest,
            round_s,
            self._pool.slots,
            self._pool.nbytes / 1e6,
        )

    # --- downloads ------------------------------------------------------------------------------

    def published_round(self, fragment: int | None) -> int:
        if fragment is None:
            return self.require_store().round
        return self.require_units()[fragment].published_round

    async def wait_published(self, fragment: int | None, min_round: int, timeout: float) -> bool:
        """Long-poll until the model (or one fragment) has a published round >= ``min_round``."""
        store = self.require_store()
        if fragment is None:
            return await store.wait_for_round(min_round, timeout)
        unit = self.require_units()[fragment]
        return await store.wait_until(lambda: unit.published_round >= min_round, timeout)

    async def snapshot(self, fragment: int | None = None) -> Snapshot:
        store = self.require_store()
        if fragment is None:
            return await store.open_snapshot()
        unit = self.require_units()[fragment]
        return await store.open_parts(
            lambda: unit.header(store.instance), unit.ranges, unit.published_round
        )

    def count_download(self, worker_id: str | None, nbytes: int) -> None:
        self.bytes_out += nbytes
        record = self.registry.get(worker_id) if worker_id else None
        if record is not None:
            record.bytes_out += nbytes

    # --- control --------------------------------------------------------------------------------

    def kick(self, worker_id: str) -> dict[str, Any]:
        """Evict a worker on request. Its accepted submission stays counted; a kicked worker
        that is still running gets 410 at its next request and may re-join."""
        if worker_id not in self.registry:
            raise unknown_worker(worker_id)
        log.warning("worker %s kicked by an operator (round %d)", worker_id, self._round())
        self.kicks += 1
        return self.deregister(worker_id, died=False)

    def outer_optimizers(self) -> list[torch.optim.Optimizer]:
        """Every outer optimizer the server steps (one per fragment when streaming)."""
        return [u.optimizer for u in self.units]

    def set_outer_hparams(
        self, lr: float | None = None, momentum: float | None = None
    ) -> dict[str, Any]:
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
        return {"status": "ok", "outer_optimizer": optimizer_hparams(optimizers[0])}

    def set_num_workers(self, num_workers: int) -> dict[str, Any]:
        """Change how many workers the run expects (round 0 waits for them; never below
        ``min_workers``)."""
        if isinstance(num_workers, bool) or not isinstance(num_workers, int):
            raise bad_request("bad_field", "num_workers must be an integer")
        if num_workers < self.config.min_workers:
            raise bad_request(
                "bad_field",
                f"num_workers must be >= min_workers ({self.config.min_workers}), "
                f"got {num_workers}",
            )
        live = self.registry.ids()
        for unit in self.units:
            if unit.barrier is not None:
                unit.barrier.set_num_workers(num_workers, live)
        self.num_workers = num_workers  # units planned later start from it
        log.info("expected workers set to %d (round %d)", num_workers, self._round())
        self._maybe_close()
        return {"status": "ok", "num_workers": num_workers}

    # --- status ---------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """The JSON of ``GET /status`` (``server/status.py`` builds and types it)."""
        return build_status(self).to_json()


SyncCoordinator = Coordinator  # the name before async mode; kept for callers


def _merge_states(
    optimizers: list[torch.optim.Optimizer],
) -> tuple[dict[str, Any], list[list[int]]]:
    """One state dict for all units' optimizers (parameter indices offset, groups
    concatenated), and per unit [parameters, groups] to split it again."""
    state: dict[int, Any] = {}
    groups: list[dict[str, Any]] = []
    shape: list[list[int]] = []
    offset = 0
    for opt in optimizers:
        sd = opt.state_dict()
        count = sum(len(g["params"]) for g in sd["param_groups"])
        for idx, entry in sd["state"].items():
            state[int(idx) + offset] = entry
        for group in sd["param_groups"]:
            groups.append({**group, "params": [int(i) + offset for i in group["params"]]})
        shape.append([count, len(sd["param_groups"])])
        offset += count
    return {"state": state, "param_groups": groups}, shape


def _split_states(merged: dict[str, Any], shape: list[list[int]] | None) -> list[dict[str, Any]]:
    """Inverse of ``_merge_states``. No shape: a checkpoint of one optimizer."""
    if shape is None:
        return [merged]
    out = []
    p_off = g_off = 0
    for count, ngroups in shape:
        groups = [
            {**g, "params": [int(i) - p_off for i in g["params"]]}
            for g in merged["param_groups"][g_off : g_off + ngroups]
        ]
        state = {
            int(i) - p_off: v for i, v in merged["state"].items() if p_off <= int(i) < p_off + count
        }
        out.append({"state": state, "param_groups": groups})
        p_off += count
        g_off += ngroups
    return out


def _payload_order_add(
    unit: Unit,
    layout: Layout,
    tensors: list[torch.Tensor],
    weight: float,
    report: Callable[[int], None],
) -> Callable[[], None]:
    """The add of one landed body to ``unit``'s sum, in the order of the bytes, reporting after
    each piece how far the body has been read (so the receive buffer refills behind it)."""
    where = {
        spec.name: (begin, spec.itemsize)
        for spec, (begin, _) in zip(layout.specs, layout.offsets, strict=True)
    }
    index = {name: i for i, name in enumerate(unit.names)}
    order = [index[spec.name] for spec in layout.specs]
    begins = [where[name] for name in unit.names]

    def on_piece(i: int, end: int) -> None:
        begin, itemsize = begins[i]
        report(begin + end * itemsize)

    return lambda: unit.sum.add(tensors, weight, order=order, on_piece=on_piece)


def _first_non_finite(tensors: dict[str, torch.Tensor]) -> str | None:
    """Name of the first tensor holding NaN or an infinity. NaN propagates into the minimum and
    maximum and an infinity is one of them, so aminmax sees both without building a boolean
    tensor as large as the upload (and about 20 times faster than isfinite().all())."""
    for name, t in tensors.items():
        if t.is_floating_point() and t.numel():
            low, high = torch.aminmax(t)
            if not (bool(torch.isfinite(low)) and bool(torch.isfinite(high))):
                return name
    return None
