"""The relay's front: the parameter server's (``paramserver/coordinator.py``) with three
differences. Its units get ``RelayAggregator``s, whose rounds close upstream; its parameters come
from the upstream (or, when the upstream has none, from its first worker, offered upstream
before they are taken); and beside the health loop it keeps the upstream link alive
(registration, heartbeats, the region size the upstream shows). Its checkpoints carry the
link's state, so a restarted relay is the same worker upstream and its uploads keep their ids.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from diloco.persistence import Checkpoint
from diloco.server.config import ServerConfig
from diloco.server.errors import conflict
from diloco.server.observe.status import Status, build_status
from diloco.server.params.store import ParamStore
from diloco.server.paramserver.coordinator import Coordinator
from diloco.server.paramserver.startup import find_checkpoint
from diloco.server.relay import pending as on_disk
from diloco.server.relay.aggregator import RelayAggregator
from diloco.server.relay.pending import Pending
from diloco.server.relay.upstream import (
    HEARTBEAT_S,
    Params,
    RelayRefused,
    RelayStopped,
    Upstream,
)
from diloco.server.rounds.aggregator import Aggregator
from diloco.server.rounds.units import Unit
from diloco.wire import Layout
from diloco.wire.decode import AsyncStream
from diloco.wire.messages import ParamsSeeded
from diloco.worker.transport.client import ServerError

log = logging.getLogger(__name__)


class RelayCoordinator(Coordinator):
    """A regional relay's front (``Front``)."""

    def __init__(
        self,
        config: ServerConfig,
        upstream: Upstream | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.upstream = upstream or Upstream(config)
        super().__init__(config, None, None, clock)
        self.checkpoints.extra_state = self.upstream.state
        self._registered = asyncio.Event()
        #: A round that closed before a restart and was not published (``relay/pending.py``).
        self._pending: Pending | None = None

    def _aggregator(self, unit: Unit, round_: int) -> Aggregator:
        return RelayAggregator(unit, self.steps, round_, self.upstream)

    def _adopt_store(self, store: ParamStore, true: dict[str, torch.Tensor] | None = None) -> None:
        super()._adopt_store(store, true)
        self.upstream.table = tuple((s.name, s.shape) for s in store.specs)

    def restore(self, ckpt: Checkpoint) -> None:
        """Resume from the relay's checkpoint, and from the round that closed after it, if one
        did: its receipts are restored at once, so a worker's re-sent upload of it is answered
        as counted (``duplicate``), never added to the round a second time."""
        self.upstream.restore(ckpt.extra)
        super().restore(ckpt)
        save_dir = self.config.save_dir
        closed = on_disk.read(save_dir) if save_dir is not None else None
        if closed is None:
            return
        assert save_dir is not None
        (unit,) = self.model.require_units()
        if closed.relay_round != unit.round:  # older than the checkpoint: published since
            on_disk.discard(save_dir)
            return
        agg = unit.aggregator
        assert isinstance(agg, RelayAggregator)
        for sid in closed.receipts:
            agg.restore_receipt(sid, closed.relay_round)
        agg.barrier.closing = True  # its uploads are all in ``closed``: it takes no more
        self._pending = closed

    # --- the upstream link ----------------------------------------------------------------------

    async def run(self) -> None:
        await asyncio.gather(super().run(), self._link())

    def close(self) -> None:
        self.upstream.stopping.set()
        self.upstream.client.close()  # its keep-alive connections would hold the upstream's exit
        super().close()

    async def _link(self) -> None:
        up = self.upstream
        try:
            await self._join()
            while True:
                await asyncio.sleep(HEARTBEAT_S)
                up.region = len(self.registry.ids())
                try:
                    await asyncio.to_thread(up.retrying, "heartbeat", up.heartbeat)
                except ServerError as exc:  # one beat lost; the next may pass
                    log.warning("relay: heartbeat upstream: %s", exc)
        except RelayStopped:
            return
        except (RelayRefused, ServerError) as exc:  # shown in /status as upstream.last_error
            up.last_error = up.last_error or str(exc)
            log.error("relay: %s", exc)

    async def _join(self) -> None:
        """Register upstream; a fresh relay takes the upstream's parameters (and saves them at
        once, so its id is on disk before its first upload), a resumed one keeps its own."""
        up = self.upstream
        up.region = len(self.registry.ids())
        reply = await asyncio.to_thread(up.retrying, "register", up.register)
        self._registered.set()
        log.info("relay %s registered upstream at %s", up.relay_id, up.url)
        store = self.model.store
        if reply.has_params and store is None:
            _, params = await asyncio.to_thread(up.fetch, 0)
            await self._take(params)
        elif not reply.has_params and store is not None:
            theirs = await asyncio.to_thread(up.seed, store.copy_out())
            if theirs is not None:
                log.warning("relay: the upstream was seeded meanwhile; keeping the relay's state")
        closed, self._pending = self._pending, None
        if closed is not None:
            (unit,) = self.model.require_units()
            assert isinstance(unit.aggregator, RelayAggregator)
            await unit.aggregator.resume(closed)

    async def _take(self, params: Params) -> None:
        if self.model.store is not None:
            return
        self._adopt_store(ParamStore.from_tensors(params))
        log.info("relay: parameters of upstream round %s", self.upstream.round)
        await self.save()

    async def receive_initial(
        self, layout: Layout, stream: AsyncStream, worker_id: str
    ) -> ParamsSeeded:
        """The relay's first worker seeds it only when the upstream has no parameters either:
        they are offered upstream first. When the upstream has some, the relay takes those and
        the worker is answered as a second seeder is (409 ``already_initialized``: download)."""
        store = await self.intake.receive_initial(layout, stream, worker_id)
        await self._registered.wait()
        theirs = await asyncio.to_thread(self.upstream.seed, store.named())
        if theirs is not None:
            await self._take(theirs[1])
            raise conflict(
                "already_initialized", "the upstream server has parameters; download them instead"
            )
        if self.model.store is not None:
            raise conflict("already_initialized", "the relay already has parameters")
        self._adopt_store(store)
        self.run_log.bytes_in += layout.total_size
        log.info("initial parameters from worker %s, seeded upstream", worker_id)
        await self.save()
        fragments, fragment_rounds = self.model.plan()
        return ParamsSeeded(
            round=store.round,
            num_params=store.numel,
            fragments=fragments,
            fragment_rounds=fragment_rounds,
        )

    # --- status ---------------------------------------------------------------------------------

    def status(self, history_since: int = 0) -> Status:
        status = build_status(self, history_since)
        return replace(status, upstream=self.upstream.public(len(self.registry.ids())))


def start_relay(config: ServerConfig) -> RelayCoordinator:
    """A relay's front, resumed from its save dir or fresh (its parameters then come from the
    upstream once it runs)."""
    checkpoint = find_checkpoint(config)
    relay = RelayCoordinator(config)
    if checkpoint is not None:
        relay.restore(checkpoint)
    return relay
