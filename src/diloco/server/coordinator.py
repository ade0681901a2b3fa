"""Synchronous DiLoCo on the server: registry, barrier, running sum and outer step together.

Everything here runs on the server's event loop thread, so barrier and registry state need no
locks. Tensor work (adding an upload to the sum, the outer step) runs in worker threads; the
``_tensor_lock`` orders it. No lock is held while bytes travel on a socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import torch

from diloco.core import (
    WeightedSum,
    apply_outer_step,
    default_outer_optimizer,
    optimizer_hparams,
    set_optimizer_hparams,
)
from diloco.server.barrier import SyncBarrier, Verdict
from diloco.server.config import ServerConfig
from diloco.server.errors import ApiError, bad_request, conflict, unknown_worker
from diloco.server.params import ParamStore, Snapshot
from diloco.server.persistence import Checkpoint, save_checkpoint
from diloco.server.registry import WorkerRegistry
from diloco.wire import Layout, WireError, aread_payload, byte_view, check_against, tensor_views
from diloco.wire.decode import AsyncStream

log = logging.getLogger(__name__)

OptimizerFactory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]
UPLOAD_DTYPES = ("F32", "BF16")


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
    if not (math.isfinite(weight) and weight > 0):
        raise bad_request(
            "bad_metadata", f"__metadata__['weight'] must be finite and positive, got {raw!r}"
        )
    return weight


class SyncCoordinator:
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
        self.barrier = SyncBarrier(
            config.num_workers, config.min_workers, round=store.round if store else 0
        )
        self._factory = optimizer_factory or (
            lambda params: default_outer_optimizer(
                params, config.outer_lr, config.outer_momentum, config.nesterov
            )
        )
        self.store: ParamStore | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.sum: WeightedSum | None = None
        self._tensor_lock = asyncio.Lock()
        self._pool: BufferPool | None = None
        self._initializing = False
        self.last_save: dict[str, Any] | None = None
        self.resumed_from: str | None = None
        self.last_round_contributions = 0
        self.last_save_error: str | None = None
        self.started_at = clock()
        self.bytes_in = 0
        self.bytes_out = 0
        self.rejected = 0
        self.kicks = 0
        self.round_times: list[float] = []
        self._round_started = clock()
        self._closing_task: asyncio.Task[None] | None = None
        if store is not None:
            self._adopt_store(store)

    # --- parameters ---------------------------------------------------------------------------

    def _adopt_store(self, store: ParamStore) -> None:
        self.store = store
        self.optimizer = self._factory(store.params)
        self.sum = WeightedSum([tuple(s.shape) for s in store.specs])
        self._pool = BufferPool(store.nbytes, self.config.upload_slots)
        self.barrier.round = store.round

    def restore(self, ckpt: Checkpoint) -> None:
        """Resume from a checkpoint: parameters, outer optimizer state, counters, receipts."""
        order = ckpt.extra.get("param_order") or list(ckpt.params)
        if sorted(order) != sorted(ckpt.params):
            raise ValueError(f"{ckpt.path}: param_order does not match the saved parameters")
        store = ParamStore.from_tensors({n: ckpt.params[n] for n in order}, round=ckpt.round)
        self._adopt_store(store)
        assert self.optimizer is not None
        self.optimizer.load_state_dict(ckpt.optimizer_state)
        for sid, counted_in in ckpt.extra.get("receipts", []):
            self.barrier.history[str(sid)] = int(counted_in)
        self.registry.deaths = int(ckpt.extra.get("worker_deaths", 0))
        self.resumed_from = str(ckpt.path)
        log.info("resumed from %s at round %d", ckpt.path, ckpt.round)

    def _write_checkpoint(self, round_: int) -> Path:
        """Blocking: write the parameters and optimizer state as of ``round_``. The caller holds
        the tensor lock (nothing changes them mid-write) and runs this off the event loop."""
        assert (
            self.config.save_dir is not None
            and self.store is not None
            and self.optimizer is not None
        )
        store = self.store
        extra = {
            "param_order": [s.name for s in store.specs],
            # Submissions counted in rounds before round_ are inside these parameters.
            "receipts": [[sid, r] for sid, r in list(self.barrier.history.items()) if r < round_],
            "worker_deaths": self.registry.deaths,
            "instance": store.instance,
        }
        path = save_checkpoint(
            self.config.save_dir,
            round_,
            store.named(),
            self.optimizer.state_dict(),
            extra,
            self.config.keep_checkpoints,
        )
        self.last_save = {"round": round_, "path": str(path)}
        log.info("saved round %d to %s", round_, path)
        return path

    async def save(self) -> Path | None:
        """Write a checkpoint now (off the event loop). None when saving is not configured.

        The tensor lock keeps the outer step from changing parameters or momentum mid-write;
        uploads being received and downloads go on meanwhile."""
        if self.config.save_dir is None or self.store is None:
            return None
        async with self._tensor_lock:
            return await asyncio.to_thread(self._write_checkpoint, self.require_store().round)

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
        finally:
            self._initializing = False
        self._adopt_store(store)
        self.bytes_in += layout.total_size
        log.info(
            "initial parameters from worker %s: %d tensors, %d parameters",
            worker_id,
            len(store.specs),
            store.numel,
        )
        return {"status": "ok", "round": store.round, "num_params": store.numel}

    # --- membership ---------------------------------------------------------------------------

    def register(
        self, worker_id: str | None, hostname: str, info: dict[str, Any]
    ) -> dict[str, Any]:
        worker_id = worker_id or f"w-{uuid.uuid4().hex[:10]}"
        record, new = self.registry.add(worker_id, hostname, info)
        self.barrier.on_register(self.registry.ids())
        log.info(
            "worker %s %s from %s (round %d)",
            worker_id,
            "registered" if new else "re-registered",
            hostname,
            self.barrier.round,
        )
        self._maybe_close()
        reply: dict[str, Any] = {
            "worker_id": worker_id,
            "round": self.barrier.round,
            "mode": "sync",
            "instance": self.store.instance if self.store else None,
            "has_params": self.store is not None,
            "num_workers": self.barrier.num_workers,
            "poll_timeout": self.config.poll_timeout,
        }
        last = info.get("last_submission_id")
        if isinstance(last, str) and last:
            # A worker that lost its connection asks whether its last upload was counted in a
            # round whose result is in our parameters; if not it keeps that progress (rebases).
            counted = self.barrier.history.get(last)
            reply["last_submission"] = {
                "counted_in": counted,
                "in_params": counted is not None and counted < self.barrier.round,
            }
        if self.store is not None:
            reply["params"] = [[s.name, list(s.shape)] for s in self.store.specs]
        return reply

    def deregister(self, worker_id: str, *, died: bool = False) -> dict[str, Any]:
        if self.registry.remove(worker_id, died=died) is None:
            raise unknown_worker(worker_id)
        self.barrier.on_leave(worker_id)
        log.info(
            "worker %s %s (round %d)", worker_id, "evicted" if died else "left", self.barrier.round
        )
        self._maybe_close()
        return {"status": "ok", "round": self.barrier.round}

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
        record = self.registry.touch(
            worker_id
        )  # validated first: a rejected request changes nothing
        assert record is not None
        for key, value in updates.items():
            setattr(record, key, value)
        return {"status": "ok", "round": self.barrier.round}

    def check_health(self) -> list[str]:
        """Evict silent and stuck workers; returns their ids. Called periodically, and directly
        by tests with a fake clock."""
        evicted = []
        reasons = {}
        if self.config.heartbeat_timeout > 0:
            reasons.update(
                {w: "silent" for w in self.registry.silent(self.config.heartbeat_timeout)}
            )
        if self.config.stuck_timeout > 0:
            reasons.update({w: "stuck" for w in self.registry.stuck(self.config.stuck_timeout)})
        for worker_id, why in reasons.items():
            log.warning("evicting worker %s: %s (round %d)", worker_id, why, self.barrier.round)
            self.deregister(worker_id, died=True)
            evicted.append(worker_id)
        return evicted

    async def health_loop(self) -> None:
        timeouts = [t for t in (self.config.heartbeat_timeout, self.config.stuck_timeout) if t > 0]
        if not timeouts:
            return
        interval = max(0.05, min(timeouts) / 4)
        while True:
            await asyncio.sleep(interval)
            self.check_health()

    # --- submissions --------------------------------------------------------------------------

    async def submit(self, layout: Layout, stream: AsyncStream) -> dict[str, Any]:
        store = self.require_store()
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
        check_against(layout, store.table, UPLOAD_DTYPES)
        duplicate = self._verdict(worker_id, base_round, submission_id)
        if duplicate is not None:
            return duplicate
        assert self._pool is not None
        self.barrier.begin_upload(worker_id, submission_id)
        try:
            async with self._pool.take() as buf:
                await aread_payload(stream, byte_view(buf[: layout.payload_size]))
                views = tensor_views(layout, buf[: layout.payload_size])
                tensors = [views[s.name] for s in store.specs]
                bad = await asyncio.to_thread(
                    _first_non_finite, dict(zip(store.table, tensors, strict=True))
                )
                if bad is not None:
                    raise ApiError(
                        422, "non_finite", f"pseudo-gradient {bad!r} has NaN or infinite values"
                    )
                if self.registry.get(worker_id) is None:
                    raise unknown_worker(worker_id)  # evicted while uploading
                if self.barrier.uploading.get(worker_id) != submission_id:
                    # The worker left and came back while this body was in flight.
                    raise conflict(
                        "superseded",
                        "this upload was superseded; rebase",
                        action="rebase",
                        round=self.barrier.round,
                    )
                # From here on the submission counts: record it, then queue the addition on the
                # tensor lock before yielding, so a round close queued later sees this sum.
                self.barrier.record(worker_id, submission_id)
                async with self._tensor_lock:
                    await asyncio.to_thread(self._require_sum().add, tensors, weight)
        except BaseException:
            self.barrier.abort_upload(worker_id, submission_id)
            self._maybe_close()
            raise
        self.registry.touch(worker_id)
        record.submissions += 1
        record.last_round = base_round
        record.bytes_in += layout.total_size
        self.bytes_in += layout.total_size
        self._maybe_close()
        return {
            "status": "accepted",
            "round": base_round,
            "submission_id": submission_id,
            "instance": self.require_store().instance,
        }

    def _verdict(
        self, worker_id: str, base_round: int, submission_id: str
    ) -> dict[str, Any] | None:
        """None to accept; the reply for a duplicate; raises 409 for everything else."""
        check = self.barrier.check(worker_id, base_round, submission_id)
        v = check.verdict
        if v is Verdict.ACCEPT:
            return None
        if v is Verdict.DUPLICATE:
            # Not an error: a retry of an upload that was already counted. Say where it went.
            return {
                "status": "duplicate",
                "round": check.counted_in,
                "submission_id": submission_id,
                "instance": self.require_store().instance,
            }
        self.rejected += 1
        details = {
            Verdict.STALE: f"computed against round {base_round}, the server is at round {check.round}; rebase onto the current parameters",
            Verdict.FUTURE: f"names round {base_round}, the server is at round {check.round}; rebase onto the current parameters",
            Verdict.NOT_EXPECTED: f"round {check.round} opened before this worker joined; keep training, it takes part from round {check.round + 1}",
            Verdict.ALREADY_SUBMITTED: f"this worker already contributed to round {check.round}; wait for its result",
            Verdict.IN_PROGRESS: "an upload from this worker is still being received; retry shortly",
            Verdict.CLOSING: f"round {check.round} is closing; rebase onto its result",
        }
        action = {
            Verdict.STALE: "rebase",
            Verdict.FUTURE: "rebase",
            Verdict.NOT_EXPECTED: "continue",
            Verdict.ALREADY_SUBMITTED: "wait",
            Verdict.IN_PROGRESS: "retry",
            Verdict.CLOSING: "rebase",
        }[v]
        raise conflict(v.value, details[v], round=check.round, action=action)

    def _require_sum(self) -> WeightedSum:
        assert self.sum is not None
        return self.sum

    # --- rounds -------------------------------------------------------------------------------

    def _maybe_close(self) -> None:
        if self.barrier.ready() and self.store is not None:
            round_ = self.barrier.begin_close()
            self._closing_task = asyncio.get_running_loop().create_task(self._close(round_))

    async def _close(self, round_: int) -> None:
        try:
            await self._apply_round(round_)
        except Exception:  # the round stays closing; nothing would make it succeed on retry
            log.exception("outer step of round %d failed", round_)
            raise

    async def _apply_round(self, round_: int) -> None:
        store, optimizer, wsum = self.require_store(), self.optimizer, self._require_sum()
        assert optimizer is not None
        async with self._tensor_lock:
            count, total = wsum.count, wsum.total_weight

            every = self.config.save_every
            durable = self.config.save_dir is not None and every > 0 and (round_ + 1) % every == 0

            def step() -> None:
                apply_outer_step(optimizer, store.params, wsum.mean_())
                wsum.reset()
                if durable:
                    # Written before the result is published: no worker ever adopts parameters
                    # a crash could take back, so no accepted contribution is lost with them.
                    try:
                        self._write_checkpoint(round_ + 1)
                    except OSError as exc:  # a full disk must not stop training
                        self.last_save_error = f"round {round_ + 1}: {exc}"
                        log.error("checkpoint of round %d failed: %s", round_ + 1, exc)

            await store.update(step, new_round=round_ + 1)
        now = self.clock()
        self.last_round_contributions = count
        self.round_times.append(now - self._round_started)
        self._round_started = now
        self.barrier.advance(self.registry.ids())
        log.info(
            "round %d closed: %d contributions (weight %.3g); round %d open",
            round_,
            count,
            total,
            round_ + 1,
        )
        self._maybe_close()

    async def snapshot(self) -> Snapshot:
        return await self.require_store().open_snapshot()

    def count_download(self, worker_id: str | None, nbytes: int) -> None:
        self.bytes_out += nbytes
        record = self.registry.get(worker_id) if worker_id else None
        if record is not None:
            record.bytes_out += nbytes

    # --- control ------------------------------------------------------------------------------

    def kick(self, worker_id: str) -> dict[str, Any]:
        """Evict a worker on request. Its accepted submission stays counted; a kicked worker
        that is still running gets 410 at its next request and may re-join."""
        if worker_id not in self.registry:
            raise unknown_worker(worker_id)
        log.warning("worker %s kicked by an operator (round %d)", worker_id, self.barrier.round)
        self.kicks += 1
        return self.deregister(worker_id, died=False)

    def outer_optimizers(self) -> list[torch.optim.Optimizer]:
        """Every outer optimizer the server steps (one per fragment when streaming)."""
        return [self.optimizer] if self.optimizer is not None else []

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
        if num_workers < self.barrier.min_workers:
            raise bad_request(
                "bad_field",
                f"num_workers must be >= min_workers ({self.barrier.min_workers}), "
                f"got {num_workers}",
            )
        self.barrier.set_num_workers(num_workers, self.registry.ids())
        log.info("expected workers set to %d (round %d)", num_workers, self.barrier.round)
        self._maybe_close()
        return {"status": "ok", "num_workers": self.barrier.num_workers}

    # --- status -------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        store = self.store
        return {
            "mode": "sync",
            "instance": store.instance if store else None,
            "uptime_s": round(self.clock() - self.started_at, 3),
            **self.barrier.public(),
            "has_params": store is not None,
            "num_params": store.numel if store else 0,
            "model_bytes": store.nbytes if store else 0,
            # Outer steps that had to copy the parameters because a download still held them.
            "copies_on_write": store.copies_on_write if store else 0,
            "outer_optimizer": optimizer_hparams(self.optimizer) if self.optimizer else None,
            "weighting": self.config.weighting,
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
            "rejected_submissions": self.rejected,
            "last_round_contributions": self.last_round_contributions,
            "last_round_time_s": round(self.round_times[-1], 4) if self.round_times else None,
            "registrations": self.registry.registrations,
            "worker_deaths": self.registry.deaths,
            "heartbeat_timeout": self.config.heartbeat_timeout,
            "stuck_timeout": self.config.stuck_timeout,
            "save_dir": self.config.save_dir,
            "last_save": self.last_save,
            "last_save_error": self.last_save_error,
            "resumed_from": self.resumed_from,
            "workers": self.registry.public(),
        }


class BufferPool:
    """Upload receive buffers, at most ``slots`` of them, allocated on first use."""

    def __init__(self, nbytes: int, slots: int) -> None:
        self.nbytes = nbytes
        self._free: asyncio.Queue[torch.Tensor] = asyncio.Queue()
        self._to_create = slots

    @contextlib.asynccontextmanager
    async def take(self) -> AsyncIterator[torch.Tensor]:
        if self._free.empty() and self._to_create > 0:
            self._to_create -= 1
            buf = torch.empty(self.nbytes, dtype=torch.uint8)
        else:
            buf = await self._free.get()
        try:
            yield buf
        finally:
            self._free.put_nowait(buf)


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
