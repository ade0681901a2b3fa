"""A worker's heartbeats: a daemon thread that tells the server the worker is alive, how fast it
trains and its last loss, and follows DyLU's recommended ``sync_every``.

The thread only reads the session's counters and raises ``need_rejoin`` when the server no
longer knows the worker; the training thread does the re-join at its next step.
"""

from __future__ import annotations

import logging
import threading
import time

from diloco.wire.messages import HeartbeatReply, Registered
from diloco.worker.session import Session
from diloco.worker.settings import WorkerSettings
from diloco.worker.transport.client import SYNC_FAILURES, UnknownWorker

log = logging.getLogger(__name__)


class Heartbeats:
    """Started once registered (``start``), stopped when the worker leaves (``stop``)."""

    def __init__(self, session: Session, settings: WorkerSettings) -> None:
        self._s = session
        self._settings = settings
        self._stop = threading.Event()
        self.thread: threading.Thread | None = None
        self._speed_mark = (time.monotonic(), 0, 0.0)  # time, total steps, stall seconds

    def start(self) -> None:
        """Start the thread (once; not at all with ``heartbeat_interval`` 0)."""
        if self._settings.heartbeat_interval > 0 and self.thread is None:
            self.thread = threading.Thread(target=self._loop, name="diloco-heartbeat", daemon=True)
            self.thread.start()

    def stop(self) -> None:
        """Stop the thread and wait for it (at most 5 s: a heartbeat in flight has timeouts)."""
        self._stop.set()
        if self.thread is not None:
            self.thread.join(timeout=5)

    def adopt_recommendation(self, reply: Registered | HeartbeatReply) -> None:
        """DyLU: with ``dylu`` on, take the server's recommended ``sync_every`` (slower workers
        take fewer local steps, so all hand in work at about the same rate). The training thread
        reads it at its next step; an int assignment needs no lock."""
        s = self._s
        value = reply.recommended_sync_every
        if not self._settings.dylu or value is None:
            return
        value = max(value, self._settings.num_fragments, 1)
        if value != s.sync_every:
            log.info("worker %s: sync_every %d -> %d (DyLU)", s.worker_id, s.sync_every, value)
            s.sync_every = value
            s.metrics["sync_every"] = value

    def _steps_per_second(self) -> float | None:
        s = self._s
        now = time.monotonic()
        t, steps, stall = self._speed_mark
        stall_now = s.metrics["stall_time_s"]
        busy = (now - t) - (stall_now - stall)
        total = s.total_steps
        self._speed_mark = (now, total, stall_now)
        if busy <= 0 or total == steps:
            return None
        return (total - steps) / busy

    def _loop(self) -> None:
        s = self._s
        while not self._stop.wait(self._settings.heartbeat_interval):
            assert s.worker_id is not None
            try:
                reply = s.client.heartbeat(
                    s.worker_id,
                    steps_per_second=self._steps_per_second(),
                    loss=s.loss,
                    step_age_s=time.monotonic() - s.last_step_at,
                    syncing=s.syncing,
                )
                self.adopt_recommendation(HeartbeatReply.from_json(reply))
            except UnknownWorker:
                s.need_rejoin.set()  # the training thread re-joins at its next step
            except SYNC_FAILURES as exc:  # a reply that does not read is a WireError
                log.warning("worker %s: heartbeat failed: %s", s.worker_id, exc)
