"""Receiving upload bodies: the one owner of the upload slots, the first write's stages, the
first write in progress and the adds not yet finished.

An accepted upload lands here in one of two ways. The round's first upload may be written into
its unit's running sum as it arrives (server/first_write.py), when the aggregator allows it and
nothing else owns that sum. Every other upload is received whole into an upload slot
(server/upload_slots.py), checked, and handed to the aggregator with an ``add`` that queues its
addition on the tensor lock behind any first write. Either way the body is checked (finite, its
worker still registered and current) before the aggregator counts it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import torch

from diloco.server.aggregator import Aggregator, Landed
from diloco.server.config import ServerConfig
from diloco.server.errors import ApiError, bad_request, conflict, unknown_worker
from diloco.server.first_write import FirstWrite, Stages
from diloco.server.model import Model
from diloco.server.params import ParamStore
from diloco.server.registry import WorkerRegistry
from diloco.server.run_log import RunLog
from diloco.server.units import Unit, plan_pieces
from diloco.server.upload_slots import Drain, SlotPool
from diloco.wire import Layout, PayloadReader, WireError, aread_payload, byte_view, tensor_views
from diloco.wire.decode import AsyncStream


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
            if self.model.fragmenting is not None:
                plan_pieces(store, *self.model.fragmenting)  # refuse a model that cannot be split
        except ValueError as exc:
            raise bad_request("bad_fragments", str(exc)) from None
        finally:
            self._initializing = False
            self.registry.end_transfer(uploader)
        return store

    async def receive(
        self,
        unit: Unit,
        layout: Layout,
        stream: AsyncStream,
        worker_id: str,
        submission_id: str,
        base: int,
        weight: float,
    ) -> dict[str, Any]:
        """Receive an accepted upload's body and hand it to the unit's aggregator; returns the
        aggregator's reply fields. Raises (and counts nothing) if the body is cut, non-finite,
        or its worker is gone or superseded when it ends."""
        agg = unit.aggregator
        first = self._begin_first_write(unit, agg, layout, weight, worker_id)
        if first is None:
            return await self._into_slot(
                unit, layout, stream, worker_id, submission_id, base, weight
            )
        self.run_log.waited(unit.index, 0.0)
        try:
            await first.run(PayloadReader(stream))
            self._check_current(unit, worker_id, submission_id)
            landed = Landed(worker_id, submission_id, base, weight, layout.total_size, [], True)
            return await agg.accept(landed)
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
        self,
        unit: Unit,
        layout: Layout,
        stream: AsyncStream,
        worker_id: str,
        submission_id: str,
        base: int,
        weight: float,
    ) -> dict[str, Any]:
        """The ordinary path: the whole body into an upload slot, checked, then counted."""
        assert self.pool is not None
        agg = unit.aggregator
        async with self.pool.take() as lease:
            self.run_log.waited(unit.index, lease.waited_s)
            payload = lease.slot.buffer[: layout.payload_size]
            await aread_payload(stream, byte_view(payload), room=lease.slot.room)
            views = tensor_views(layout, payload)
            tensors = [views[n] for n in unit.names]
            landed = Landed(worker_id, submission_id, base, weight, layout.total_size, tensors)
            if agg.reads_late():  # the update reads the body under the lease
                await self._check_upload(unit, worker_id, submission_id, tensors)
                return await agg.accept(landed)
            # The next upload may start filling this buffer behind the add.
            drain = await lease.hand_over()
            try:
                await self._check_upload(unit, worker_id, submission_id, tensors)
                landed.sum_add = _payload_order_add(unit, layout, tensors, weight, drain.report)
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
        self, unit: Unit, worker_id: str, submission_id: str, tensors: list[torch.Tensor]
    ) -> None:
        """What a landed body must pass before it counts: finite values, its worker still
        registered, and no newer upload of the same worker begun meanwhile."""
        bad = await asyncio.to_thread(first_non_finite, dict(zip(unit.names, tensors, strict=True)))
        if bad is not None:
            raise ApiError(422, "non_finite", f"pseudo-gradient {bad!r} has NaN or infinite values")
        self._check_current(unit, worker_id, submission_id)

    def _check_current(self, unit: Unit, worker_id: str, submission_id: str) -> None:
        """The worker of a landed body is still registered and began no newer upload."""
        if self.registry.get(worker_id) is None:
            raise unknown_worker(worker_id)  # evicted while uploading
        if not unit.aggregator.is_current(worker_id, submission_id):
            # The worker left and came back while this body was in flight.
            raise conflict(
                "superseded",
                "this upload was superseded; rebase",
                action="rebase",
                round=unit.round,
                **self.model.which(unit),
            )


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


def first_non_finite(tensors: dict[str, torch.Tensor]) -> str | None:
    """Name of the first tensor holding NaN or an infinity. NaN propagates into the minimum and
    maximum and an infinity is one of them, so aminmax sees both without building a boolean
    tensor as large as the upload (and about 20 times faster than isfinite().all())."""
    for name, t in tensors.items():
        if t.is_floating_point() and t.numel():
            low, high = torch.aminmax(t)
            if not (bool(torch.isfinite(low)) and bool(torch.isfinite(high))):
                return name
    return None
