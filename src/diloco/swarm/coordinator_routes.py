"""CoordinatorRoutes: the ``Routes`` a driver reads when its swarm runs under a coordinator
(``diloco server --swarm``), backed by the coordinator's route table.

A background thread long polls ``GET /swarm/routes?version=N`` with the client's timeouts and
keeps the last table; ``endpoints(k)`` answers from it at once (never from the network), in the
table's order: the fastest reported replica first. ``suspect`` reports the replica to the
coordinator (``POST /swarm/suspect``, one attempt) and leaves it out locally at once, until a
table newer than the one that dropped it lists it again (it heartbeat again, or said ready
again). The driver never waits on the coordinator: a report that fails only keeps the replica
out here until a later table lists it. While the coordinator is unreachable (it restarts) the
last table stays, so drivers keep training through it; a restarted coordinator's tables
(versions from 0 again, replicas listed as they say ready again) replace it, but a stage the
new life lists no replica of yet keeps the old life's replicas until it lists one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from diloco.swarm.routing import Endpoint
from diloco.wire.messages.codec import MessageError
from diloco.wire.messages.swarm import Replica, RouteTable, SuspectNoted
from diloco.worker.transport.client import SYNC_FAILURES, DiLoCoClient

log = logging.getLogger(__name__)

RETRY_S = 1.0
"""Pause after a failed poll (the client has retried with backoff already)."""


class CoordinatorRoutes:
    """Live replicas per stage from the coordinator. ``start`` begins the long poll;
    ``stop`` ends it (a poll in flight ends with the server's ``poll_timeout``, unseen)."""

    def __init__(self, client: DiLoCoClient, worker_id: str, token: str | None) -> None:
        self._client, self._worker_id, self._token = client, worker_id, token
        self._table: RouteTable | None = None
        self._peers: dict[str, tuple[str, int]] = {}  # address -> (peer id, stage)
        self._suspects: dict[str, int] = {}  # address -> version a listing must be newer than
        # A restarted coordinator lists a replica once it said ready again: until then the last
        # life's replicas of a stage it lists none of are still called (the data plane runs).
        self._carried: dict[int, tuple[Replica, ...]] = {}
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- lifecycle -----------------------------------------------------------------------------

    def start(self) -> CoordinatorRoutes:
        if self._thread is None:
            self._thread = threading.Thread(target=self._poll, name="swarm-routes", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()

    def _poll(self) -> None:
        version = -1
        try:
            while not self._stop.is_set():
                try:
                    table = RouteTable.from_json(self._client.routes(version))
                except (*SYNC_FAILURES, MessageError) as exc:
                    log.warning("swarm routes: poll failed: %s", exc)
                    self._stop.wait(RETRY_S)
                    continue
                if table.version != version:
                    # The poller's answers come in order: a version below the one held is a
                    # new server life (a restart counts from 0 again), never an old answer.
                    self.adopt(table, new_life=0 <= table.version < version)
                version = table.version
        finally:
            self._client.end_thread()

    def adopt(self, table: RouteTable, *, new_life: bool = False) -> None:
        """Take ``table`` as the current one (the poller does; tests may too). ``new_life``:
        the coordinator restarted, so its versions count again from 0 and the suspects' marks
        (versions of the old life) mean nothing: its listing is taken as it is."""
        with self._cond:
            if new_life:
                self._suspects.clear()
                if self._table is not None:  # kept per stage until the new life lists one
                    self._carried = {st.stage: st.replicas for st in self._table.stages}
            elif self._table is not None and table.version < self._table.version:
                return  # an older answer overtaken by a newer one
            self._table = table
            for st in table.stages:
                if st.replicas:
                    self._carried.pop(st.stage, None)
            listed = {}
            for stage in table.stages:
                for r in stage.replicas:
                    listed[r.address] = (r.peer_id, stage.stage)
            self._peers.update(listed)
            for address, after in list(self._suspects.items()):
                if address in listed and table.version > after:
                    del self._suspects[address]  # back: it heartbeat or said ready again
            self._cond.notify_all()

    # --- Routes --------------------------------------------------------------------------------

    @property
    def version(self) -> int:
        """The version of the table held (-1: none yet)."""
        with self._cond:
            return -1 if self._table is None else self._table.version

    def endpoints(self, stage: int) -> list[Endpoint]:
        with self._cond:
            return self._endpoints(stage)

    def _endpoints(self, stage: int) -> list[Endpoint]:
        if self._table is None or not 0 <= stage < len(self._table.stages):
            return []
        replicas = self._table.stages[stage].replicas or self._carried.get(stage, ())
        return [
            Endpoint(r.address, self._token) for r in replicas if r.address not in self._suspects
        ]

    def suspect(self, endpoint: Endpoint, reason: str) -> None:
        with self._cond:
            self._suspects[endpoint.url] = self._version_locked()
            known = self._peers.get(endpoint.url)
        if known is None:
            return  # not from a table of ours: nothing to tell the coordinator
        peer, stage = known
        try:
            noted = SuspectNoted.from_json(
                self._client.suspect(self._worker_id, suspect=peer, stage=stage, reason=reason)
            )
        except (*SYNC_FAILURES, MessageError) as exc:
            log.warning("swarm routes: reporting %s (stage %d) failed: %s", peer, stage, exc)
            return
        with self._cond:
            if endpoint.url in self._suspects:
                # The table of ``noted.version`` lacks it: only a newer one may list it again.
                self._suspects[endpoint.url] = max(self._suspects[endpoint.url], noted.version)

    def _version_locked(self) -> int:
        return -1 if self._table is None else self._table.version

    def wait_for_replica(self, stage: int, timeout: float) -> bool:
        return self.wait(lambda: bool(self._endpoints(stage)), timeout)

    def wait_for(self, stages: range, timeout: float) -> bool:
        """Wait until each of ``stages`` has a live replica (at most ``timeout`` seconds)."""
        return self.wait(lambda: all(self._endpoints(k) for k in stages), timeout)

    def wait(self, ready: Callable[[], bool], timeout: float) -> bool:
        """Wait until ``ready()`` (called under the lock, after each table) holds, at most
        ``timeout`` seconds; False when it did not (or the poll stopped)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not ready():
                left = deadline - time.monotonic()
                if left <= 0 or self._stop.is_set():
                    return False
                self._cond.wait(left)
            return True

    @property
    def suspects(self) -> dict[str, int]:
        with self._cond:
            return dict(self._suspects)
