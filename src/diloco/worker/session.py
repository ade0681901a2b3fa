"""What a worker's lifecycle and its sync strategy share: one object, handed to the strategy.

``DiLoCoWorker`` owns the lifecycle (the optimizer hook, heartbeats, joining and leaving); a sync
strategy (``PlainSync``, ``StreamingSync``, ``QuorumSync``) decides when and how the model is
exchanged. Both read and write the state here, and nothing else of each other: the run's identity
(worker id, the round the snapshot holds), the training loop's counters, the flag the heartbeat
thread raises when the server forgot this worker, and the one full download into the snapshot.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping

import torch

from diloco.wire import WireError
from diloco.worker.settings import WorkerSettings
from diloco.worker.state.encoder import UploadEncoder
from diloco.worker.state.local_model import LocalModel
from diloco.worker.state.update_buffer import lossy_downlink
from diloco.worker.transport.client import SYNC_FAILURES, DiLoCoClient, UnknownWorker

log = logging.getLogger(__name__)


def initial_metrics(sync_every: int) -> dict[str, float]:
    """A new worker's ``sync_metrics`` counters (the lifecycle and the strategy update them).
    ``late_merges``: uploads a quorum-round server counted in a round after their base round
    (the round closed while they arrived; their steps counted, weighted for lateness).
    ``last_bytes_up``/``last_bytes_down``: the last sync's (plain) or fragment exchange's
    (streaming) bytes; ``residual_norm``: the error-feedback residual's norm after the last
    counted upload (0 for fp32 and bf16, which keep none). With a compressed downlink:
    ``update_downloads`` rounds received as updates, ``full_downloads`` as full parameters, and
    ``checksum_mismatches`` updates whose result differed from the server's (each followed by
    a full download). In all-reduce mode ``discarded_rounds`` counts quorums that failed (a
    member died or timed out) and were repeated, ``excluded_rounds`` rounds whose checks left
    this worker's contribution out (its steps are counted in ``dropped_steps``), and
    ``collective_bytes`` the payload this
    worker averaged with its quorums (the pseudo-gradient in the communication dtype, or its
    int8/int4 slots of scales and codes, per round), ``collective_sent`` and
    ``collective_received`` its bytes to and from the other members (a quantized quorum's as
    moved; a dense one's as a ring all-reduce moves them, 2(N-1)/N of the payload each way:
    ``worker/allreduce/quantized.count_bytes``)."""
    return {
        "rounds": 0,
        "bytes_up": 0,
        "bytes_down": 0,
        "sync_time_s": 0.0,
        "stall_time_s": 0.0,
        "barrier_wait_s": 0.0,
        "retries": 0,
        "reconnections": 0,
        "rebases": 0,
        "failed_syncs": 0,
        "refused_submissions": 0,
        "late_merges": 0,
        "sync_every": sync_every,
        "peak_sync_bytes_up": 0,
        "peak_sync_bytes_down": 0,
        "fragments_sent": 0,
        "stalls": 0,
        "dropped_steps": 0,
        "last_bytes_up": 0,
        "last_bytes_down": 0,
        "residual_norm": 0.0,
        "update_downloads": 0,
        "full_downloads": 0,
        "checksum_mismatches": 0,
        "discarded_rounds": 0,
        "excluded_rounds": 0,
        "collective_bytes": 0,
        "collective_sent": 0,
        "collective_received": 0,
    }


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
        encoder: UploadEncoder,
    ) -> None:
        self.settings = settings
        self.client = client
        self.local = local
        #: The codec, and the error-feedback residual of a lossy one: every upload's body.
        self.encoder = encoder
        self.metrics = metrics
        #: Register again and reconcile the model with what the server holds (the worker's
        #: re-join). Raises a network error if the server cannot be reached.
        self.rejoin = rejoin
        self.worker_id: str | None = settings.worker_id
        self.base_round = 0  # the round of the parameters in the snapshot
        self.instance = ""
        self.last_metadata: dict[str, str] = {}  # of the last full download (not of updates)
        #: The next download must be full parameters (a re-join: the server may have restarted
        #: from an older checkpoint, so the snapshot is not offered as a base for an update).
        self.full_next = False
        self.sync_every = settings.sync_every
        self.local_step = 0  # inner steps since the last sync (plain) or in this period
        self.total_steps = 0
        self.samples = 0.0  # reported since the last upload (its weight)
        # The loop reports samples (``DiLoCoWorker.report``): 0 reported means nothing trained.
        self.reports_samples = False
        self.tokens = 0.0  # as ``samples``, in tokens (``DiLoCoWorker.report(tokens=...)``)
        self.reports_tokens = False
        #: The server's ``--weighting`` as its registration reply says (None: it did not say).
        self.weighting: str | None = None
        self.loss: float | None = None  # the last reported, sent with uploads and heartbeats
        self.syncing = False  # blocked in a sync: a silent loop is not hung
        self.last_step_at = time.monotonic()  # read by the heartbeat thread: is the loop alive?
        #: Set by the heartbeat thread when the server does not know this worker; the training
        #: thread re-joins at its next sync.
        self.need_rejoin = threading.Event()
        #: Error feedback a strategy keeps beside the encoder's (all-reduce mode's quorum
        #: residuals, ``allreduce/quantized.py``): its tensors for a checkpoint
        #: (``resume.codec_state``), and a resumed checkpoint's, which that strategy takes when
        #: it is chosen (the join comes after ``resume.start_resumed`` sets them).
        self.saved_feedback: Callable[[], dict[str, torch.Tensor]] = dict
        self.resumed_feedback: Mapping[str, torch.Tensor] = {}

    def fetch(self, min_round: int, deadline: float | None = None, *, adopt: bool = False) -> bool:
        """Long-poll until the global parameters of ``min_round`` or later are in the snapshot.
        False if ``deadline`` passes first. With ``adopt``, the model takes each parameter's new
        values as its bytes land (``local.adopted`` says whether all of them did).

        With a compressed downlink (``worker/state/update_buffer.py``) a clean snapshot asks for the
        next round as an update; an update whose checksum does not match, or that cannot be applied,
        is followed by one full download of that round."""
        t0 = time.monotonic()
        receiver = self.local.receiver(adopt)
        have = self._have_round()
        try:
            while True:
                try:
                    got = self.client.download(
                        receiver.into,
                        min_round=min_round,
                        worker_id=self.worker_id,
                        on_progress=receiver.progress if adopt else None,
                        have_round=have,
                    )
                except WireError as exc:
                    if have is None or exc.code != "bad_update":
                        raise
                    log.warning("worker %s: %s; downloading full parameters", self.worker_id, exc)
                    have = None
                    continue
                if got is None:
                    if deadline is not None and time.monotonic() > deadline:
                        return False
                    continue
                if receiver.update:
                    try:
                        applied = self.local.apply_update()
                    except WireError as exc:  # a malformed sparse update: nothing changed
                        if exc.code != "bad_update":
                            raise
                        log.warning(
                            "worker %s: %s; downloading full parameters", self.worker_id, exc
                        )
                        have, min_round = None, got.round
                        continue
                    if not applied:
                        self.metrics["checksum_mismatches"] += 1
                        log.warning(
                            "worker %s: round %d's checksum differs from the parameters its "
                            "update gives here; downloading full parameters",
                            self.worker_id,
                            got.round,
                        )
                        have, min_round = None, got.round
                        continue
                    self.metrics["update_downloads"] += 1
                else:
                    receiver.landed()
                    self.metrics["full_downloads"] += 1
                    self.full_next = False
                    self.last_metadata = dict(got.layout.metadata)
                self.base_round = got.round
                self.instance = got.instance
                return True
        finally:
            self.metrics["barrier_wait_s"] += time.monotonic() - t0

    def _have_round(self) -> int | None:
        """The round to offer the server as held (an update may then follow), or None when
        only full parameters will do: no compressed downlink, a re-join, or no clean snapshot."""
        if not self.local.takes_updates or self.full_next or not self.local.snapshot:
            return None
        if not lossy_downlink(self.last_metadata):
            return None
        return None if self.local.snapshot_dirty else self.base_round

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

    def stall(self, wait: Callable[[], object]) -> None:
        """The training loop waits (``wait()``) for a fragment's exchange or round still in
        flight: a stall, counted with its time; the heartbeats see the loop syncing meanwhile."""
        self.metrics["stalls"] += 1
        t0 = time.monotonic()
        self.syncing = True
        wait()
        self.syncing = False
        self.metrics["stall_time_s"] += time.monotonic() - t0

    def upload_tokens(self, tokens: float) -> float | None:
        """The tokens an upload says it represents (``tokens``: counted since the last upload of
        that part of the model); None when the loop reports none. ``RuntimeError`` when the
        server weights by tokens and the loop reported none: the server would refuse every
        upload (400), and the worker would train on without ever being merged."""
        if self.reports_tokens and tokens > 0:
            return tokens
        if self.weighting == "tokens":
            raise RuntimeError(
                "the server weights uploads by tokens (--weighting tokens) but the training "
                "loop reported none since the last sync: call worker.report(tokens=n) after "
                "each step (the Lightning and Hugging Face integrations count them from the "
                "batch's attention_mask or input_ids), or run the server with --weighting samples"
            )
        return None

    def drop_steps(self, steps: int, message: str, *args: object, error: bool = False) -> None:
        """Count ``steps`` local steps as dropped (the server holds the progress they are mixed
        with, or lost it) and say so in the log."""
        self.metrics["dropped_steps"] += steps
        (log.error if error else log.warning)(message, self.worker_id, *args)
