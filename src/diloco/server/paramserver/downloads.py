"""``GET /global_params`` on the parameter server: the long poll until the model (or one
fragment) has the round a worker waits for, the snapshot that pins its bytes while they stream
(server/params/store.py), and counting what was sent.
"""

from __future__ import annotations

from collections.abc import Callable

from diloco.server.config import ServerConfig
from diloco.server.errors import unknown_worker
from diloco.server.members.registry import WorkerRegistry
from diloco.server.observe.run_log import RunLog
from diloco.server.params.store import Snapshot
from diloco.server.rounds.synced_model import Model
from diloco.wire.messages import Pending


class Downloads:
    """Serves the published parameters; holds no state of its own."""

    def __init__(
        self, config: ServerConfig, model: Model, registry: WorkerRegistry, run_log: RunLog
    ) -> None:
        self.config = config
        self.model = model
        self.registry = registry
        self.run_log = run_log

    async def download(
        self,
        worker_id: str | None,
        raw_fragment: str | None,
        min_round: Callable[[], int],
        have_round: int | None = None,
    ) -> Snapshot | Pending:
        """``GET /global_params``: the snapshot to stream once the model (or one fragment) has
        a published round >= ``min_round()``, or the 202 reply when none came within
        ``poll_timeout``. The snapshot's ``sent`` counts the bytes once they are sent.

        With a download codec other than fp32, a worker that says it holds round ``have_round``
        gets the kept update when it leads from there to the published round
        (server/params/update_bodies.py, server/params/sparse_bodies.py);
        anyone else (a joiner, a worker that missed a round) gets full parameters."""
        # A worker waiting (503) for another's initial upload has joined as well as one served.
        self.registry.fetching(worker_id)
        self.model.require_store()
        if worker_id and worker_id not in self.registry:
            raise unknown_worker(worker_id)
        fragment = None if raw_fragment is None else self.model.fragment_index(raw_fragment)
        wanted = min_round()
        if not await self.wait_published(fragment, wanted, self.config.poll_timeout):
            return Pending(round=self.published_round(fragment), fragment=fragment)
        downlink = self.model.updates  # compressed or sparse
        snap = None
        if downlink is not None and fragment is None and have_round is not None:
            snap = await downlink.open_update(have_round)
        update = snap is not None
        if snap is None:
            snap = await self.snapshot(fragment)
        size = snap.total_size
        snap.on_sent = lambda: self.count_download(worker_id, size, update=update)
        return snap

    def published_round(self, fragment: int | None) -> int:
        if fragment is None:
            return self.model.require_store().round
        return self.model.require_units()[fragment].published_round

    async def wait_published(self, fragment: int | None, min_round: int, timeout: float) -> bool:
        """Long-poll until the model (or one fragment) has a published round >= ``min_round``."""
        store = self.model.require_store()
        if fragment is None:
            return await store.wait_for_round(min_round, timeout)
        unit = self.model.require_units()[fragment]
        return await store.wait_until(lambda: unit.published_round >= min_round, timeout)

    async def snapshot(self, fragment: int | None = None) -> Snapshot:
        store = self.model.require_store()
        if fragment is None:
            return await store.open_snapshot()
        unit = self.model.require_units()[fragment]
        return await store.open_parts(
            lambda: unit.header(store.instance), unit.ranges, unit.published_round
        )

    def count_download(self, worker_id: str | None, nbytes: int, *, update: bool = False) -> None:
        self.run_log.sent(nbytes, update=update)
        record = self.registry.get(worker_id) if worker_id else None
        if record is not None:
            record.bytes_out += nbytes
