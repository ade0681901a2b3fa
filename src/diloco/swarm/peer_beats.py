"""A swarm peer's heartbeats: a daemon thread that tells the coordinator the peer is alive and
what it measured (``Heartbeat.swarm``: throughput, the bytes and tokens it SENT per boundary
and direction, reroutes, recoveries and recomputes, all cumulative but the throughput).

The worker's own ``Heartbeats`` reads a training session's counters (steps, stalls, DyLU),
none of which a stage service has; this loop keeps its shape and its timeouts (the client's)
and reads a peer's ``stats`` instead.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from diloco.wire.messages.codec import MessageError
from diloco.wire.messages.registration import BoundaryTraffic, HeartbeatReply, SwarmBeat
from diloco.worker.transport.client import SYNC_FAILURES, DiLoCoClient, UnknownWorker

log = logging.getLogger(__name__)


def boundary_index(name: str) -> int:
    """``"0->1"`` is boundary 0 (between stages 0 and 1)."""
    return int(name.split("->", 1)[0])


def swarm_beat(stats: Mapping[str, Any], throughput: float | None) -> SwarmBeat:
    """The heartbeat's swarm part from a peer's ``stats()``: ``sent`` (``{"0->1:forward":
    {"bytes", "tokens", ...}}``), ``reroutes`` and ``recoveries`` (a driver's; 0 otherwise), ``recomputes`` (a
    served replica's)."""
    sent = []
    for key, counts in sorted(stats.get("sent", {}).items()):
        name, direction = key.rsplit(":", 1)
        sent.append(
            BoundaryTraffic(
                boundary_index(name), direction, int(counts["bytes"]), int(counts["tokens"])
            )
        )
    return SwarmBeat(
        throughput=throughput,
        boundaries=tuple(sent),
        reroutes=int(stats.get("reroutes", 0)),
        recoveries=int(stats.get("recoveries", 0)),
        recomputes=int(stats.get("recomputes", 0)),
    )


class PeerBeats:
    """Heartbeats every ``interval`` seconds from ``start`` to ``stop``. ``stats()`` gives the
    peer's counters, ``samples()`` the samples its stage processed so far (the throughput is
    their rate between two beats). ``lost`` is set when the coordinator no longer knows the
    peer (410: it restarted, or evicted the peer) until a beat goes through again;
    ``after(reply)`` (None: 410) runs after each answered beat (``peer_life.py``: register again, say ready
    again), on the thread that beat."""

    def __init__(
        self,
        client: DiLoCoClient,
        worker_id: str,
        interval: float,
        stats: Callable[[], Mapping[str, Any]],
        samples: Callable[[], int],
        after: Callable[[HeartbeatReply | None], None] | None = None,
    ) -> None:
        self._client, self._worker_id, self.interval = client, worker_id, interval
        self._stats, self._samples, self._after = stats, samples, after
        self._stop = threading.Event()
        self.lost = threading.Event()
        self._mark = (time.monotonic(), 0)
        self._lock = threading.Lock()  # the loop and a caller of ``beat`` share the mark
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self.interval > 0 and self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="swarm-heartbeat", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)  # a beat in flight has the client's timeouts

    def _throughput(self) -> float | None:
        with self._lock:
            now, samples = time.monotonic(), self._samples()
            then, before = self._mark
            self._mark = (now, samples)
        if samples == before or now <= then:
            return None  # nothing processed: keep the last reported (an absent number)
        return (samples - before) / (now - then)

    def beat(self) -> None:
        """One heartbeat now (the loop's; tests call it to report at an exact moment)."""
        beat = swarm_beat(self._stats(), self._throughput())
        reply = None
        try:
            reply = HeartbeatReply.from_json(self._client.heartbeat(self._worker_id, swarm=beat))
            self.lost.clear()
        except UnknownWorker:
            self.lost.set()
            log.warning("swarm peer %s: the coordinator no longer knows it", self._worker_id)
        except (*SYNC_FAILURES, MessageError) as exc:
            log.warning("swarm peer %s: heartbeat failed: %s", self._worker_id, exc)
            return  # unreachable: nothing learned (the data plane goes on)
        if self._after is not None:
            self._after(reply)

    def _loop(self) -> None:
        try:
            while not self._stop.wait(self.interval):
                self.beat()
        finally:
            self._client.end_thread()
