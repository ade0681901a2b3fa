"""What a worker's lifecycle and its sync strategy share: one object, handed to the strategy.

``DiLoCoWorker`` owns the lifecycle (the optimizer hook, heartbeats, joining and leaving); a
sync strategy (``PlainSync``, ``StreamingSync``) decides when and how the model is exchanged.
Both read and write the state here, and nothing else of each other: the run's identity (worker
id, the round the snapshot holds), the training loop's counters, the flag the heartbeat thread
raises when the server forgot this worker, and the one full download into the snapshot.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from diloco.worker.client import SYNC_FAILURES, DiLoCoClient, UnknownWorker
from diloco.worker.local_model import LocalModel
from diloco.worker.settings import WorkerSettings

log = logging.getLogger(__name__)


class Session:
    """A worker's place in a run and its training loop's counters.

    Written by the training thread only, except ``sync_every`` (DyLU, from the heartbeat
    thread: an int assignment, read at the next step) and ``need_rejoin`` (an Event)."""

    def __init__(
        self,
        settings: WorkerSettings,
        client: DiLoCoClient,
        local: LocalModel,
        metrics: dict[str, float],
        rejoin: Callable[[], None],
    ) -> None:
        self.settings = settings
        self.client = client
        self.local = local
        self.metrics = metrics
        #: Register again and reconcile the model with what the server holds (the worker's
        #: re-join). Raises a network error if the server cannot be reached.
        self.rejoin = rejoin
        self.worker_id: str | None = settings.worker_id
        self.base_round = 0  # the round of the parameters in the snapshot
        self.instance = ""
        self.last_metadata: dict[str, str] = {}  # of the last full download
        self.sync_every = settings.sync_every
        self.local_step = 0  # inner steps since the last sync (plain) or in this period
        self.total_steps = 0
        self.samples = 0.0  # reported since the last upload (its weight)
        self.loss: float | None = None  # the last reported, sent with uploads and heartbeats
        self.syncing = False  # blocked in a sync: a silent loop is not hung
        self.last_step_at = time.monotonic()  # read by the heartbeat thread: is the loop alive?
        #: Set by the heartbeat thread when the server does not know this worker; the training
        #: thread re-joins at its next sync.
        self.need_rejoin = threading.Event()

    def fetch(self, min_round: int, deadline: float | None = None, *, adopt: bool = False) -> bool:
        """Long-poll until the global parameters of ``min_round`` or later are in the snapshot.
        False if ``deadline`` passes first. With ``adopt``, the model takes each parameter's new
        values as its bytes land (``local.adopted`` says whether all of them did)."""
        t0 = time.monotonic()
        receiver = self.local.receiver(adopt)
        try:
            while True:
                got = self.client.download(
                    receiver.into,
                    min_round=min_round,
                    worker_id=self.worker_id,
                    on_progress=receiver.progress if adopt else None,
                )
                if got is not None:
                    receiver.landed()
                    self.base_round = got.round
                    self.instance = got.instance
                    self.last_metadata = dict(got.layout.metadata)
                    return True
                if deadline is not None and time.monotonic() > deadline:
                    return False
        finally:
            self.metrics["barrier_wait_s"] += time.monotonic() - t0

    def refresh(self, *, counted: bool, min_round: int, deadline: float | None = None) -> bool:
        """``LocalModel.refresh`` with the parameters of ``min_round`` or later."""
        return self.local.refresh(
            lambda adopt: self.fetch(min_round, deadline, adopt=adopt), counted=counted
        )

    def recover_snapshot(self) -> None:
        """A download broke off mid-payload after every retry: the model holds progress and the
        snapshot is partly overwritten. Nothing is trainable until a full download succeeds."""
        while True:
            try:
                self.refresh(counted=self.local.progress_counted, min_round=0)
                return
            except UnknownWorker:
                try:  # the server restarted or evicted us: register again, then download
                    self.rejoin()
                    return
                except SYNC_FAILURES as exc:
                    log.error("worker %s: re-join failed: %s", self.worker_id, exc)
            except SYNC_FAILURES as exc:
                log.error(
                    "worker %s: waiting for the server to rebuild the snapshot: %s",
                    self.worker_id,
                    exc,
                )

    def drop_steps(self, steps: int, message: str, *args: object, error: bool = False) -> None:
        """Count ``steps`` local steps as dropped (the server holds the progress they are mixed
        with, or lost it) and say so in the log."""
        self.metrics["dropped_steps"] += steps
        (log.error if error else log.warning)(message, self.worker_id, *args)
