"""The registry of live workers and what the server knows of each."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from diloco.server.members.rates import Rate
from diloco.wire.messages import RegisterInfo


@dataclass
class WorkerInfo:
    worker_id: str
    hostname: str
    registered_at: float
    last_seen: float
    info: RegisterInfo = field(default_factory=RegisterInfo)  # what it said at registration
    steps_per_second: float | None = None  # as its last heartbeat said
    speed_reported_at: float | None = None  # when a heartbeat last said it
    # Its inner steps so far, as its uploads said: its speed long before the first heartbeat.
    step_counts: Rate = field(default_factory=Rate)
    loss: float | None = None
    submissions: int = 0
    last_round: int | None = None
    bytes_in: int = 0
    bytes_out: int = 0
    step_age_s: float | None = None  # seconds since the worker's last optimizer step, as reported
    syncing: bool = False
    smoothed_speed: float | None = None  # steps/s, smoothed over heartbeats (DyLU)
    recommended_sync_every: int | None = None  # DyLU's last recommendation
    staleness: int | None = None  # async: staleness of the last applied submission
    # The codec of its uploads: as it registered (None: it asked for none, raw uploads), then
    # as its last upload said (server/intake/upload_body.py).
    codec: str | None = None
    # Whether it fetched parameters, heartbeated or uploaded since registering: until then it
    # may be a ghost (a worker that failed while joining, a registration whose reply was lost).
    joined: bool = False
    transfers: int = 0  # tensor bodies it is sending now (the initial parameters)


class WorkerRegistry:
    """Live workers by id. Mutated only from the server's event loop thread."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._workers: dict[str, WorkerInfo] = {}
        self.deaths = 0
        self.registrations = 0
        self.kicks = 0  # evictions an operator asked for (/control/kick_worker)

    def __contains__(self, worker_id: object) -> bool:
        return worker_id in self._workers

    def __len__(self) -> int:
        return len(self._workers)

    def __iter__(self) -> Iterator[WorkerInfo]:
        return iter(list(self._workers.values()))

    def ids(self) -> set[str]:
        return set(self._workers)

    def get(self, worker_id: str) -> WorkerInfo | None:
        return self._workers.get(worker_id)

    def add(self, worker_id: str, hostname: str, info: RegisterInfo) -> tuple[WorkerInfo, bool]:
        """Register (or refresh) a worker. Returns the record and whether it is new."""
        now = self._clock()
        existing = self._workers.get(worker_id)
        if existing is not None:
            existing.last_seen = now
            existing.hostname = hostname
            existing.info = info
            return existing, False
        record = WorkerInfo(worker_id, hostname, now, now, info)
        self._workers[worker_id] = record
        self.registrations += 1
        return record, True

    def touch(self, worker_id: str) -> WorkerInfo | None:
        record = self._workers.get(worker_id)
        if record is not None:
            record.last_seen = self._clock()
            record.joined = True
        return record

    def fetching(self, worker_id: str | None) -> None:
        """A download was asked for: proof enough that the worker got past its join's checks
        (its first heartbeat may come long after: the interval is 30 s by default)."""
        record = self._workers.get(worker_id) if worker_id else None
        if record is not None:
            record.joined = True

    def begin_transfer(self, worker_id: str) -> WorkerInfo | None:
        """A tensor body from this worker is under way: however long it takes, the worker is
        no ghost. ``end_transfer`` with the record returned."""
        record = self._workers.get(worker_id)
        if record is not None:
            record.transfers += 1
        return record

    def end_transfer(self, record: WorkerInfo | None) -> None:
        if record is not None:
            record.transfers -= 1
            record.last_seen = self._clock()  # the join deadline starts again from here

    def reported_speed(self, record: WorkerInfo, steps_per_second: float | None) -> None:
        """A heartbeat said how fast the worker trains (None: it did not say)."""
        if steps_per_second is not None:
            record.steps_per_second = steps_per_second
            record.speed_reported_at = self._clock()

    def counted_steps(self, record: WorkerInfo, steps: int) -> None:
        """An upload of the worker said it has taken ``steps`` inner steps so far."""
        record.step_counts.add(self._clock(), steps)

    def speed(self, record: WorkerInfo) -> float | None:
        """The worker's inner steps per second: from the newer of its last heartbeat and its
        uploads' step counts (two uploads give one). The heartbeat's leaves out time spent
        blocked in syncs, the uploads' does not; either is the latest word on it."""
        measured = record.step_counts.rate(self._clock())
        uploaded_at = record.step_counts.last_time
        if measured is None or uploaded_at is None:
            return record.steps_per_second
        if record.speed_reported_at is not None and record.speed_reported_at >= uploaded_at:
            return record.steps_per_second
        return round(measured, 4)

    def unjoined(self, timeout: float) -> list[str]:
        """Workers that registered more than ``timeout`` seconds ago and never showed they got
        further (see ``WorkerInfo.joined``), unless a transfer of theirs is under way."""
        now = self._clock()
        return [
            w.worker_id
            for w in self._workers.values()
            if not w.joined and w.transfers == 0 and now - w.last_seen > timeout
        ]

    def remove(self, worker_id: str, *, died: bool) -> WorkerInfo | None:
        record = self._workers.pop(worker_id, None)
        if record is not None and died:
            self.deaths += 1
        return record

    def silent(self, timeout: float) -> list[str]:
        """Workers not heard from for longer than ``timeout`` seconds."""
        now = self._clock()
        return [w.worker_id for w in self._workers.values() if now - w.last_seen > timeout]

    def stuck(self, timeout: float) -> list[str]:
        """Workers whose training loop reported no optimizer step for ``timeout`` seconds while
        not blocked in a sync (a hung loop whose heartbeat thread still runs)."""
        return [
            w.worker_id
            for w in self._workers.values()
            if w.step_age_s is not None and not w.syncing and w.step_age_s > timeout
        ]
