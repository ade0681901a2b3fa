"""Curve points of a training trial (``trials.run_trial``): the server's global parameters copied
after every outer update while the workers train (``CurveWatcher``), and the evenly spread subset
of them that gets evaluated afterwards (``thin``). Not run on its own."""

from __future__ import annotations

import threading
import time
from typing import Any

from diloco import DiLoCoServer


class CurveWatcher(threading.Thread):
    """Copies the server's global parameters after every outer update (polling its status every
    ``interval`` s: a status costs ~1 ms, a copy of the demo model ~1 ms), with the update count,
    the bytes the server has received and the time since ``t0``. The copies are evaluated after
    the run, so evaluation takes no CPU from the workers while they train."""

    def __init__(self, server: DiLoCoServer, steps: list[int], interval: float = 0.01) -> None:
        super().__init__(daemon=True)
        self.server, self.steps, self.interval = server, steps, interval
        self.points: list[dict[str, Any]] = []
        self.stop_event = threading.Event()
        self.t0 = time.monotonic()
        self._seen = -1

    def snap(self) -> None:
        point = take_point(self.server, self._seen, time.monotonic() - self.t0, sum(self.steps))
        if point is not None:
            self._seen = point["updates"]
            self.points.append(point)

    def run(self) -> None:
        while not self.stop_event.wait(self.interval):
            self.snap()


def take_point(
    server: DiLoCoServer, seen: int, wall_s: float, worker_steps: int
) -> dict[str, Any] | None:
    """A curve point (the server's update count, bytes received and global parameters, with
    ``wall_s`` and ``worker_steps``), or None while the update count is still ``seen``."""
    status = server.status()
    if status["updates"] == seen:
        return None
    return {
        "updates": status["updates"],
        "bytes_up": status["bytes_in"],
        "wall_s": wall_s,
        "worker_steps": worker_steps,
        "params": server.global_params(),
    }


def thin(points: list[Any], most: int) -> list[Any]:
    """At most ``most`` of ``points`` (all when ``most`` is 0 or there are no more), evenly
    spread by index, the first and the last always kept."""
    if most <= 0 or len(points) <= most:
        return list(points)
    if most == 1:
        return [points[-1]]
    step = (len(points) - 1) / (most - 1)
    return [points[round(i * step)] for i in range(most)]
