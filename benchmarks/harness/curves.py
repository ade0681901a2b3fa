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
        status = self.server.status()
        if status["updates"] == self._seen:
            return
        self._seen = status["updates"]
        self.points.append(
            {
                "updates": status["updates"],
                "bytes_up": status["bytes_in"],
                "wall_s": time.monotonic() - self.t0,
                "worker_steps": sum(self.steps),
                "params": self.server.global_params(),
            }
        )

    def run(self) -> None:
        while not self.stop_event.wait(self.interval):
            self.snap()


def thin(points: list[Any], most: int) -> list[Any]:
    """At most ``most`` of ``points`` (all when ``most`` is 0 or there are no more), evenly
    spread by index, the first and the last always kept."""
    if most <= 0 or len(points) <= most:
        return list(points)
    if most == 1:
        return [points[-1]]
    step = (len(points) - 1) / (most - 1)
    return [points[round(i * step)] for i in range(most)]
