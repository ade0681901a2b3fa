"""Receiving upload bodies: the one owner of the upload slots, the first write's stages, the
first write in progress and the adds not yet finished.

An accepted upload lands here in one of two ways. The round's first upload may be written into its
unit's running sum as it arrives (server/intake/first_write.py), when the aggregator allows it,
nothing else owns that sum and the body carries plain values (raw, or the fp32/bf16 codecs). Every
other upload, a lossy codec's among them, is received whole into an upload slot
(server/intake/upload_slots.py), checked, and handed to the aggregator with an ``add`` that queues
its addition on the tensor lock behind any first write (encoded tensors decode a chunk at a time
inside it: server/intake/upload_body.py). Either way the body is checked (finite values and scales,
its worker still registered and current) before the aggregator counts it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import torch

from diloco.core.accumulate import Entry
from diloco.server.config import ServerConfig
from diloco.server.errors import ApiError, bad_request, conflict, unknown_worker
from diloco.server.intake.first_write import FirstWrite, Stages
from diloco.server.intake.upload_body import UploadBody, first_non_finite
from diloco.server.intake.upload_slots import Drain, SlotPool
from diloco.server.members.registry import WorkerRegistry
from diloco.server.observe.run_log import RunLog
from diloco.server.params.store import ParamStore
from diloco.server.rounds.aggregator import Aggregator, Landed
from diloco.server.rounds.synced_model import Model
from diloco.server.rounds.units import Unit, plan_pieces
from diloco.wire import Layout, PayloadReader, WireError, aread_payload, byte_view, tensor_views
from diloco.wire.decode import AsyncStream
from diloco.wire.messages import UploadMeta, UploadReceipt


class Intake:
    """Owns the receive buffers and who may write into a unit's sum while bytes arrive."""

    def __init__(
        self,
        config: ServerConfig,
        model: Model,
        registry: WorkerRegistry,
        run_log: RunLog,
        lock: asyncio.Lock,
        clock: Callable[[], float],
    ) -> None:
        self.config = config
        self.model = model
        self.registry = registry
        self.run_log = run_log
        self.lock = lock
        self.clock = clock
        self.pool: SlotPool | None = None
        self._stages = Stages()
        #: Per unit: the first write in progress, and adds recorded but not yet finished.
        self._first_writes: dict[int, FirstWrite] = {}
        self._adds_pending: dict[int, int] = {}
        self._initializing = False

    def size_for(self, units: list[Unit]) -> None:
        """The units are planned: size the slots for the largest."""
        self.pool = SlotPool(
            max(u.nbytes for u in units), self.config.upload_slots, clock=self.clock
        )
        self.run_log.slot_sizes = (self.pool.slots, self.pool.nbytes)

    @property
    def waiting(self) -> int:
        """Uploads waiting for a slot."""
        return self.pool.waiting if self.pool else 0

    async def receive_initial(
        self, layout: Layout, stream: AsyncStream, worker_id: str
    ) -> ParamStore:
        """The initial parameters, from the first worker when the server started without:
        checked (floating point, finite, splittable into the run's fragments) into a store."""
        if worker_id not in self.registry:
            raise unknown_worker(worker_id)
        if self.model.store is not None:
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
            bad = await asyncio.to_thread(first_non_finite, tensors)
            if bad is not None:
                raise ApiError(
                    422, "non_finite", f"initial parameter {bad!r} has NaN or infinite values"
                )
            store = await asyncio.to_thread(ParamStore.from_tensors, tensors)
            if (
                self.config.keeps_true_copy
            ):  # the outer step's own copy (server/params/update_bodies.py)
                await asyncio.to_thread(store.keep_true)
            if self.model.fragmenting is not None:
                plan_pieces(store, *self.model.fragmenting)  # refuse a model that cannot be split
        except ValueError as exc:
            raise bad_request("bad_fragments", str(exc)) from None
        finally:
            self._initializing = False
            self.registry.end_transfer(uploader)
        return store

    async def receive(
        self, unit: Unit, layout: Layout, body: UploadBody, stream: AsyncStream, meta: UploadMeta
    ) -> UploadReceipt:
        """Receive an accepted upload's body (its header checked as ``body``, its metadata
        ``meta``) and hand it to the unit's aggregator; returns the aggregator's reply fields.
        Raises (and counts nothing) if the body is cut, non-finite, or its worker is gone or
        superseded when it ends."""
        agg = unit.aggregator
        first = (
            self._begin_first_write(unit, agg, layout, meta.weight, meta.worker_id)
            if body.plain
            else None
        )
        if first is None:
            return await self._into_slot(unit, layout, body, stream, meta)
        self.run_log.waited(unit.index, 0.0)
        try:
            await first.run(PayloadReader(stream))
            self._check_current(unit, meta)
            return await agg.accept(_landed(meta, layout, [], written=True))
        finally:
            first.finish(lambda: self._first_writes.pop(unit.index, None))

    def _begin_first_write(
        self, unit: Unit, agg: Aggregator, layout: Layout, weight: float, worker_id: str
    ) -> FirstWrite | None:
        """A first write for this upload if it may have the sum (the aggregator allows it,
        no add is pending, no first write under way), else None (it goes through a slot)."""
        if (
            not agg.first_write()
            or self._adds_pending.get(unit.index, 0)
            or unit.index in self._first_writes
        ):
            return None
        first = FirstWrite(unit.sum, unit.names, layout, weight, self._stages, worker_id)
        self._first_writes[unit.index] = first
        return first

    async def sum_free(self, unit: Unit) -> None:
        """Wait until no first write owns ``unit``'s sum."""
        while (first := self._first_writes.get(unit.index)) is not None:
            await first.done.wait()

    async def _into_slot(
        self, unit: Unit, layout: Layout, body: UploadBody, stream: AsyncStream, meta: UploadMeta
    ) -> UploadReceipt:
        """The ordinary path: the whole body into an upload slot, checked, then counted."""
        assert self.pool is not None
        agg = unit.aggregator
        async with self.pool.take() as lease:
            self.run_log.waited(unit.index, lease.waited_s)
            payload = lease.slot.buffer[: layout.payload_size]
            await aread_payload(stream, byte_view(payload), room=lease.slot.room)
            entries = body.entries(tensor_views(layout, payload), unit.table)
            landed = _landed(meta, layout, entries)
            if agg.reads_late():  # the update reads the body under the lease
                await self._check_upload(unit, body, meta, entries)
                return await agg.accept(landed)
            # The next upload may start filling this buffer behind the add.
            drain = await lease.hand_over()
            try:
                await self._check_upload(unit, body, meta, entries)
                landed.sum_add = lambda weight: body.add(
                    unit.sum, layout, unit.names, entries, weight, drain.report
                )
                landed.add = lambda add: self._add(unit, drain, add)
                return await agg.accept(landed)
            finally:
                drain.finish()

    async def _add(self, unit: Unit, drain: Drain, add: Callable[[], None]) -> None:
        """Run ``add`` on the tensor lock, after any first write of the unit's sum; while it
        is pending, no first write may start (the sum then counts something)."""
        pending = self._adds_pending
        pending[unit.index] = pending.get(unit.index, 0) + 1
        try:
            async with self.lock:
                await self.sum_free(unit)
                await drain.run(add)
        finally:
            pending[unit.index] -= 1

    async def _check_upload(
        self, unit: Unit, body: UploadBody, meta: UploadMeta, entries: list[Entry]
    ) -> None:
        """What a landed body must pass before it counts: finite values (and a codec's sound
        scales), its worker still registered, and no newer upload of the same worker begun
        meanwhile."""
        await asyncio.to_thread(body.check, unit.names, entries)
        self._check_current(unit, meta)

    def _check_current(self, unit: Unit, meta: UploadMeta) -> None:
        """The worker of a landed body is still registered and began no newer upload."""
        if self.registry.get(meta.worker_id) is None:
            raise unknown_worker(meta.worker_id)  # evicted while uploading
        if not unit.aggregator.is_current(meta.worker_id, meta.submission_id):
            # The worker left and came back while this body was in flight.
            raise conflict(
                "superseded",
                "this upload was superseded; rebase",
                action="rebase",
                round=unit.round,
                fragment=self.model.fragment_of(unit),
            )


def _landed(
    meta: UploadMeta, layout: Layout, entries: list[Entry], *, written: bool = False
) -> Landed:
    """The aggregator's view of a body that landed and passed its checks."""
    return Landed(
        meta.worker_id,
        meta.submission_id,
        meta.base_round,
        meta.weight,
        layout.total_size,
        entries,
        written,
    )
