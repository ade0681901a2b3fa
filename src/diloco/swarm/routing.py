"""Where a driver sends stage ``k``'s calls: the live replicas of each stage, and the choice
among them.

``Routes`` is what a driver reads: today a static table (tests, demos), later the coordinator's
route table. ``Picker`` keeps the driver's own measurements (throughput per endpoint, recent
latency per stage) and turns them into a sticky choice per step and a bounded call timeout.
"""

from __future__ import annotations

import random
import threading
from collections import deque
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Endpoint:
    """One replica of a stage: its service's base URL and the run's token."""

    url: str
    token: str | None = None


class Routes(Protocol):
    """The live endpoints of each stage, best first, and a way to report one as failing."""

    def endpoints(self, stage: int) -> list[Endpoint]:
        """Live replicas of ``stage`` (1..S-1; the head runs in the driver), best first."""
        ...

    def suspect(self, endpoint: Endpoint, reason: str) -> None:
        """``endpoint`` failed a call (reset, refusal, 5xx, timeout): leave it out."""
        ...

    def wait_for_replica(self, stage: int, timeout: float) -> bool:
        """Wait until ``stage`` has a live replica (a suspect listed again, a new one joined),
        at most ``timeout`` seconds; False when none came."""
        ...


class StaticRoutes:
    """A fixed table; a suspect endpoint is left out until ``restore``."""

    def __init__(self, table: dict[int, list[Endpoint]]) -> None:
        self._table = {k: list(v) for k, v in table.items()}
        self._suspects: dict[Endpoint, str] = {}
        self._lock = threading.Condition()

    def endpoints(self, stage: int) -> list[Endpoint]:
        with self._lock:
            return self._live(stage)

    def _live(self, stage: int) -> list[Endpoint]:
        return [e for e in self._table.get(stage, []) if e not in self._suspects]

    def suspect(self, endpoint: Endpoint, reason: str) -> None:
        with self._lock:
            self._suspects[endpoint] = reason

    def restore(self, endpoint: Endpoint) -> None:
        with self._lock:
            self._suspects.pop(endpoint, None)
            self._lock.notify_all()

    def wait_for_replica(self, stage: int, timeout: float) -> bool:
        with self._lock:
            return self._lock.wait_for(lambda: bool(self._live(stage)), timeout)

    @property
    def suspects(self) -> dict[Endpoint, str]:
        with self._lock:
            return dict(self._suspects)


class NoReplica(RuntimeError):
    """No live replica of a stage is left to send a call to."""


class Picker:
    """Throughput-weighted choice of a replica, and timeouts from recent latency.

    Throughput is samples per second of an endpoint's calls, averaged (EMA); an endpoint never
    measured weighs as much as the best measured one, so a new replica gets tried. The timeout of
    a stage's call is ``latency_factor`` times the slowest of its last ``window`` calls, at least
    ``timeout_floor_s``, and ``first_timeout_s`` before any call was measured (the first call
    of a stage includes its warm-up), never more than ``timeout_cap_s``."""

    def __init__(
        self,
        *,
        seed: int = 0,
        timeout_floor_s: float = 1.0,
        first_timeout_s: float = 30.0,
        timeout_cap_s: float = 120.0,
        latency_factor: float = 4.0,
        window: int = 16,
    ) -> None:
        if not 0 < timeout_floor_s <= timeout_cap_s:
            raise ValueError("need 0 < timeout_floor_s <= timeout_cap_s")
        self._rng = random.Random(seed)
        self.timeout_floor_s, self.first_timeout_s = timeout_floor_s, first_timeout_s
        self.timeout_cap_s, self.latency_factor = timeout_cap_s, latency_factor
        self._throughput: dict[Endpoint, float] = {}
        self._latency: dict[int, deque[float]] = {}
        self._window = window
        self._lock = threading.Lock()

    def pick(self, candidates: list[Endpoint], stage: int) -> Endpoint:
        if not candidates:
            raise NoReplica(f"no live replica of stage {stage}")
        with self._lock:
            known = [self._throughput[e] for e in candidates if e in self._throughput]
            default = max(known, default=1.0)
            weights = [self._throughput.get(e, default) for e in candidates]
            return self._rng.choices(candidates, weights)[0]

    def measured(self, stage: int, endpoint: Endpoint, samples: int, seconds: float) -> None:
        seconds = max(seconds, 1e-6)
        with self._lock:
            rate = samples / seconds
            old = self._throughput.get(endpoint)
            self._throughput[endpoint] = rate if old is None else 0.8 * old + 0.2 * rate
            self._latency.setdefault(stage, deque(maxlen=self._window)).append(seconds)

    def timeout(self, stage: int) -> float:
        with self._lock:
            recent = self._latency.get(stage)
            if not recent:
                return min(self.first_timeout_s, self.timeout_cap_s)
            t = self.latency_factor * max(recent)
        return min(max(t, self.timeout_floor_s), self.timeout_cap_s)

    def throughput(self) -> dict[str, float]:
        with self._lock:
            return {e.url: r for e, r in self._throughput.items()}
