"""A simulated clock for trials with workers of different speeds (issue 32): worker k's inner
step costs ``costs[k]`` simulated seconds (times a seeded per-step jitter), and the clock, not
sleeps or the machine's cores, decides when each worker may talk to the server.

A conservative discrete-event scheduler. Each worker thread runs its steps at whatever real
pace the CPU gives it, advancing its own simulated time; before each upload it calls ``gate``,
which lets it through only when its simulated time is the smallest of all workers still
running (ties to the lower rank) and no other worker holds the clock. The holder uploads,
downloads (async) and releases. Any worker still running has a time at least its own, so no
later upload can have happened yet: the server sees the uploads in simulated order and a worker
downloads exactly the updates that came before it in simulated time. Upload order, staleness
and the final model are then the same on every run with the same seed, however the threads are
scheduled. The server is the real one (HTTP, aggregators, Delayed Nesterov); only the moments
of the uploads are decided here.

- **Sync** (``sync=True``): a worker that has uploaded parks (it waits for the barrier, which
  must not hold the clock); when every running worker has uploaded for the round, the round
  closes at the latest upload's time, and the parked workers resume from that time: a round
  takes the slowest worker's time.
- **Grace period** (``grace`` > 0, async): a worker that has uploaded at t waits until t + grace
  to download, so the uploads of other workers that finish within the window are in the
  parameters it adopts (they all start again from the same model). It idles meanwhile; the
  wait is charged to its time.
- **Time budget** (``until``): no step starts at or after that simulated time.
- **Shared budget** (``total``): the run's inner steps go to the first ``total`` step starts in
  simulated order, whichever worker they belong to (async: fast workers take more). A step is
  granted once the steps that could still start before it cannot push it past the budget.

Used by ``trials.worker_loop`` when a ``Trial`` has a ``clock``.
"""

from __future__ import annotations

import bisect
import hashlib
import math
import random
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks.harness.curves import take_point
from diloco import DiLoCoWorker
from diloco.wire.messages import HeartbeatReply

RUNNING, WAITING, HOLDING, PARKED, DONE = "running", "waiting", "holding", "parked", "done"
STUCK_S = 300.0  # real seconds a worker may wait on the clock before the trial is declared hung


@dataclass(frozen=True)
class ClockSettings:
    """How the simulated clock runs (``Trial.clock``)."""

    jitter: float = 0.0  # each step's cost is drawn uniformly in cost x [1 - jitter, 1 + jitter]
    grace: float = 0.0  # async: simulated seconds between a worker's upload and its download
    until: float = 0.0  # > 0: no step starts at or after this simulated time (a time budget)

    def __post_init__(self) -> None:
        if not 0 <= self.jitter < 1:
            raise ValueError(f"jitter must be in [0, 1), got {self.jitter}")
        if not self.grace >= 0:
            raise ValueError(f"grace must be >= 0, got {self.grace}")
        if not self.until >= 0:
            raise ValueError(f"until must be >= 0, got {self.until}")


class SimClock:
    """The scheduler of one trial (thread-safe; every wait is on one condition variable)."""

    def __init__(
        self,
        costs: Sequence[float],
        seed: int,
        settings: ClockSettings = ClockSettings(),
        *,
        sync: bool = False,
        total: int | None = None,
    ) -> None:
        if not costs or min(costs) <= 0:
            raise ValueError(f"every step cost must be positive, got {list(costs)}")
        self.costs = list(costs)
        self.settings = settings
        self.sync = sync
        self.total = total
        n = len(costs)
        self.now = [0.0] * n
        self.state = [RUNNING] * n
        self._rng = [random.Random(f"sim-clock-{seed}-{k}") for k in range(n)]
        self._cond = threading.Condition()
        self._holder: int | None = None
        self._starts: list[tuple[float, int]] = []  # granted step starts (shared budget)
        self._ends: list[float] = []  # simulated times at which granted steps end, sorted
        self._round_uploads: dict[int, list[float]] = {}  # sync: upload times per round
        self._parked: dict[int, int] = {}  # sync: rank -> the round it waits for
        self.uploads: list[tuple[float, int]] = []  # (time, rank) of every upload, in order
        self.downloads: list[tuple[float, int]] = []  # async with grace: the deferred downloads

    # --- steps ------------------------------------------------------------------------------------

    def step(self, rank: int) -> bool:
        """Worker ``rank`` is about to take an inner step: False when the shared budget has no
        step left for it (it stops); else its time moves on by the step's cost."""
        cost = self.costs[rank] * (1 + self.settings.jitter * (2 * self._rng[rank].random() - 1))
        with self._cond:
            if self.settings.until and self.now[rank] >= self.settings.until:
                return False
            if self.total is not None:
                key = (self.now[rank], rank)
                while True:
                    before = bisect.bisect_left(self._starts, key)
                    if before >= self.total:
                        return False
                    if before + self._could_start_before(key) < self.total:
                        break
                    self._wait()
                bisect.insort(self._starts, key)
            self.now[rank] += cost
            bisect.insort(self._ends, self.now[rank])
            self._cond.notify_all()
            return True

    def _could_start_before(self, key: tuple[float, int]) -> int:
        """An upper bound on the steps other workers may still start before ``key``: a running
        worker at time t takes at most (key time - t) / its cheapest step + 1 of them."""
        bound = 0
        for j, t in enumerate(self.now):
            if j == key[1] or self.state[j] == DONE or (t, j) >= key:
                continue
            cheapest = self.costs[j] * (1 - self.settings.jitter)
            bound += math.floor((key[0] - t) / cheapest) + 1
        return bound

    def steps_done(self, at: float) -> int:
        """Inner steps of all workers that had ended by simulated time ``at``."""
        with self._cond:
            return bisect.bisect_right(self._ends, at)

    def progress(self, rank: int) -> float:
        """Shared budget: the run's expected progress in [0, 1] at this worker's time (the inner
        lr's cosine follows it): the time over the time budget, or over the time the step budget
        lasts when every worker steps without waiting."""
        if self.settings.until:
            return min(1.0, self.now[rank] / self.settings.until)
        assert self.total is not None
        rate = sum(1 / c for c in self.costs)
        return min(1.0, self.now[rank] * rate / self.total)

    # --- uploads ----------------------------------------------------------------------------------

    def gate(self, rank: int, at: float | None = None) -> float:
        """Block until worker ``rank`` (at ``at``, or its own time) is the earliest of the
        running workers and nobody holds the clock; it then holds it. Returns its time."""
        with self._cond:
            if at is not None:
                self.now[rank] = at
            self.state[rank] = WAITING
            self._cond.notify_all()
            while not self._first(rank):
                self._wait()
            self.state[rank] = HOLDING
            self._holder = rank
            return self.now[rank]

    def _first(self, rank: int) -> bool:
        if self._holder is not None:
            return False
        key = (self.now[rank], rank)
        return all(
            j == rank or self.state[j] in (DONE, PARKED) or (t, j) > key
            for j, t in enumerate(self.now)
        )

    def uploaded(self, rank: int, round_: int) -> None:
        """The holder's upload was answered (``round_``: the round or version it counted in).
        Sync: the worker parks until its round closes. Async with a grace period: it waits for
        the end of the window before it downloads."""
        with self._cond:
            assert self._holder == rank, "uploaded() without holding the clock"
            t = self.now[rank]
            self.uploads.append((t, rank))
            if self.sync:
                self._holder = None
                self.state[rank] = PARKED
                self._parked[rank] = round_
                self._round_uploads.setdefault(round_, []).append(t)
                self._close_rounds()
                self._cond.notify_all()
                return
        if self.settings.grace > 0:
            self.release(rank)
            self.gate(rank, t + self.settings.grace)
            with self._cond:
                self.downloads.append((self.now[rank], rank))

    def _close_rounds(self) -> None:
        """Sync: a round every running worker has uploaded to closes at its last upload's time."""
        live = sum(s != DONE for s in self.state)
        for r, times in list(self._round_uploads.items()):
            if len(times) < live:
                continue
            close = max(times)
            for j, waits_for in list(self._parked.items()):
                if waits_for == r:
                    del self._parked[j]
                    self.now[j] = max(self.now[j], close)
                    self.state[j] = RUNNING
            del self._round_uploads[r]

    def resumed(self, rank: int) -> None:
        """Block while worker ``rank`` is parked in a sync round. In a trial the server's barrier
        holds the worker instead; a test without a server calls this."""
        with self._cond:
            while self.state[rank] == PARKED:
                self._wait()

    def holds(self, rank: int) -> bool:
        with self._cond:
            return self._holder == rank

    def release(self, rank: int) -> None:
        """Give the clock back (a no-op when ``rank`` does not hold it)."""
        with self._cond:
            if self._holder == rank:
                self._holder = None
                self.state[rank] = RUNNING
                self._cond.notify_all()

    def finish(self, rank: int) -> None:
        """Worker ``rank`` has left the run: it no longer holds anyone back."""
        with self._cond:
            if self._holder == rank:
                self._holder = None
            self.state[rank] = DONE
            self._parked.pop(rank, None)
            if self.sync:
                self._close_rounds()
            self._cond.notify_all()

    @property
    def end(self) -> float:
        """The run's simulated length: the latest time any worker reached."""
        return max(self.now)

    def _wait(self) -> None:
        if not self._cond.wait(timeout=STUCK_S):
            raise RuntimeError(f"simulated clock stuck: states {self.state}, times {self.now}")


class ClockedWorker(DiLoCoWorker):
    """A worker whose every upload waits for its turn on the simulated clock (``clock``,
    ``rank`` set before it starts). It keeps the clock until the harness releases it after the
    optimizer step, so an async worker's download comes before anyone's later upload."""

    clock: SimClock
    rank: int

    def _submit(self, submission_id: str) -> dict[str, Any]:
        self.clock.gate(self.rank)
        reply = super()._submit(submission_id)
        self.clock.uploaded(self.rank, int(reply.get("round", 0)))
        return reply


def report_speed(worker: DiLoCoWorker, clock: SimClock, rank: int, barrier: Any) -> None:
    """DyLU on the simulated clock: every worker tells the server its simulated speed (steps per
    simulated second) once all are registered, then asks for its recommendation once all have
    told theirs, and adopts it. Speeds do not change in a clocked trial, so these two heartbeats
    are all DyLU needs; the real-time heartbeat thread stays off (its rates would be the CPU's)."""
    speed = 1 / clock.costs[rank]
    assert worker.worker_id is not None
    barrier.wait()
    worker.client.heartbeat(worker.worker_id, steps_per_second=speed)
    barrier.wait()
    reply = worker.client.heartbeat(worker.worker_id, steps_per_second=speed)
    # The worker's own follower of the recommendation (the one its heartbeat thread calls).
    worker._heartbeats.adopt_recommendation(HeartbeatReply.from_json(reply))


class ClockedRun:
    """The clock of one ``run_trial`` and its curve: the global parameters copied at each
    upload event (async: by the worker holding the clock, after its download) or round close
    (sync: by the first worker back from the round), with the simulated time of the event."""

    def __init__(self, clock: SimClock, server: Any, workers: int) -> None:
        self.clock, self.server = clock, server
        self.points: list[dict[str, Any]] = []
        self.barrier = threading.Barrier(workers, timeout=STUCK_S)  # DyLU's speed reports
        self._rounds = [0] * workers
        self._lock = threading.Lock()
        self._seen = -1

    def record(self, at: float) -> None:
        """A curve point at simulated time ``at``, unless the update count has not moved."""
        with self._lock:
            point = take_point(self.server, self._seen, at, self.clock.steps_done(at))
            if point is not None:
                self._seen = point["updates"]
                self.points.append(point)

    def after_step(self, rank: int, worker: DiLoCoWorker) -> None:
        """After each optimizer step: a sync that moved the worker's round records a point,
        then the clock is given back. A sync worker first waits for the clock to close its
        round: the server may publish the round (and the worker adopt it) before the last
        uploader has told the clock, and until then the worker's time is its upload's."""
        self.clock.resumed(rank)
        if self.clock.holds(rank) or worker.base_round != self._rounds[rank]:
            self._rounds[rank] = worker.base_round
            self.record(self.clock.now[rank])
        self.clock.release(rank)


def params_digest(params: dict[str, torch.Tensor]) -> str:
    """SHA-256 of the parameters' names and bytes, in name order: equal digests, equal bits."""
    h = hashlib.sha256()
    for name in sorted(params):
        h.update(name.encode())
        h.update(params[name].detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
