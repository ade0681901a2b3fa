"""Plain DiLoCo on the worker: the whole model is exchanged every ``sync_every`` inner steps.

A sync uploads ``snapshot - local`` piece by piece, waits for the round that counts it and
adopts its result. Failure handling follows one rule (docs/design/durability.md,
"Worker state and rebasing"): local progress is never thrown away while the server may not hold it. An accepted
upload is held by the server only in memory until its round closes, so its progress stays in the
model until a round that holds it has arrived; if that round does not come, the upload is handed
in again under the same submission id (the server answers "duplicate" if it still holds it) or,
after a re-join that says the server lost it, kept on top of the new parameters (a rebase).
Steps dropped because the server already holds the progress they are mixed with are counted
(``dropped_steps``) and logged.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from diloco.wire.messages import ParamsSeeded, Registered, UploadReceipt
from diloco.worker.server_mode.joining import (
    JoinAnswer,
    join_server,
    note_lost_adoption,
    rejoin_server,
)
from diloco.worker.session import Session
from diloco.worker.state.encoder import Upload
from diloco.worker.transport.client import SYNC_FAILURES, Conflict, UnknownWorker

log = logging.getLogger(__name__)

Submit = Callable[[str], dict[str, Any]]
"""``submit(submission_id)``: upload the model's pseudo-gradient under that id; the reply as
the server sent it (an ``UploadReceipt``; a plain dict, so a subclass wrapping the worker's
``_submit`` sees what the client returns)."""


class PlainSync:
    """The ``SyncStrategy`` of ``num_fragments == 1``."""

    def __init__(self, session: Session, submit: Submit | None = None) -> None:
        self._s = session
        # The upload goes through ``submit`` when given (the worker's ``_submit``, which a
        # subclass may wrap); it ends in ``upload``.
        self._submit = submit or self.upload
        self._last_submission: str | None = None
        # An upload sent whose answer never came (every retry failed): the server may have
        # counted it. It is sent again under the same id, so the server can say so.
        self._unresolved: str | None = None
        self._upload_steps = 0  # local steps in the last upload (counted if it is ever lost)
        # Local steps of earlier periods whose progress is still in the model, not known to be
        # the server's: a sync refused with "rebase" or "continue", or one that failed, keeps
        # them, and the next upload (or the final one at exit) hands them in with the new ones.
        self._carried = 0
        self._handed = False  # this sync handed the model's progress over (adopted a round)
        self._sent_steps = 0  # local steps in the first body sent under ``_unresolved``
        self._body: Upload | None = None  # the last upload's body, committed once it counts
        # Rounds whose result this worker adopted after its upload counted in them, with that
        # upload's local steps: if the server later says it refused one (its result would not
        # have been finite, so it discarded every upload in it), those steps are counted dropped.
        self._adopted_uploads: dict[int, int] = {}

    # --- SyncStrategy -------------------------------------------------------------------------

    @property
    def last_submission(self) -> str | None:
        return self._last_submission

    @property
    def round(self) -> int:
        return self._s.base_round

    def join(self, reply: Registered) -> None:
        join_server(self._s, self, reply)

    def rejoin(self, reply: Registered) -> str:
        return rejoin_server(self._s, self, reply)

    # --- Joining (server_mode/joining.py) -----------------------------------------------------

    def configure(self, reply: Registered | ParamsSeeded) -> None:
        pass  # the whole model is one unit: nothing to plan

    def joined(self, metadata: Mapping[str, str]) -> None:
        pass

    def rejoined(self, answer: JoinAnswer) -> str:
        # Counted in a round still open: the server holds it in memory only. The progress stays
        # here and the upload goes again under the same id: "duplicate" while the server holds
        # it, counted afresh if a crash took it.
        resend = self._last_submission if answer.held_open and not answer.seeded else None
        note_lost_adoption(self._s, answer, resend, self._upload_steps)
        # A server restarted with no state may have taken our own parameters as its initial
        # ones: then the progress is in them already.
        counted = answer.seeded or answer.in_params
        if answer.in_params and not answer.seeded and self._last_submission is not None:
            # The served parameters hold that upload's first body; the steps taken since are
            # mixed into the same local values, which the adoption below replaces: dropped, as
            # after a "duplicate" answer.
            since = self._steps_since_sent()
            if since > 0:
                self._s.drop_steps(
                    since,
                    "worker %s: its last upload is in the served parameters; the %d local steps "
                    "taken since are dropped",
                    since,
                )
        self._s.refresh(counted=counted, min_round=0)
        self._last_submission = self._unresolved = resend
        if counted:
            self._handed, self._carried = True, 0
            return "counted"
        return "held by the server, sent again at the next sync" if resend else "kept locally"

    # --- SyncStrategy: syncing ----------------------------------------------------------------

    def after_step(self) -> None:
        s = self._s
        if s.local_step >= s.sync_every or s.need_rejoin.is_set():
            self._sync()

    def sync_now(self) -> None:
        self._sync()

    def finish(self, *, submit: bool) -> None:
        pending = self._s.local_step > 0 or self._carried > 0 or self._unresolved is not None
        if submit and pending:
            self._final_submit()

    # --- one sync -----------------------------------------------------------------------------

    def upload(self, submission_id: str) -> dict[str, Any]:
        """Upload ``snapshot - local`` of the whole model under ``submission_id``."""
        s = self._s
        assert s.worker_id is not None
        self._upload_steps = s.local_step + self._carried
        weight = s.samples if s.samples > 0 else float(self._upload_steps)
        tokens = s.upload_tokens(s.tokens)
        body = self._body = s.encoder.model_upload()
        return s.client.submit_pseudogradients(
            s.worker_id,
            s.base_round,
            submission_id,
            body.specs,
            body.produce,
            weight=weight,
            tokens=tokens,
            loss=s.loss,
            steps=s.total_steps,
            codec=s.encoder.metadata,
        )

    def _counted(self, resent: bool, receipt: UploadReceipt) -> None:
        """The server answered the upload: unless it says an earlier body under the same id is
        the one it holds, this body counted, and the error-feedback residual moves now
        (``UploadEncoder``; the model has not moved since the body was encoded)."""
        if self._body is not None and not (resent and receipt.status == "duplicate"):
            self._body.commit()
        self._body = None

    def _sync(self) -> None:
        """Submit, wait for the round, adopt its result. Never raises a network error: failures
        are retried, logged, counted, and training goes on locally until the next sync."""
        s = self._s
        t0 = time.monotonic()
        up, down = s.client.bytes_up, s.client.bytes_down
        s.syncing = True
        self._handed = False
        try:
            self._sync_once()
        except SYNC_FAILURES as exc:
            s.metrics["failed_syncs"] += 1
            log.warning("worker %s: sync failed, training on locally: %s", s.worker_id, exc)
            if s.local.holds_progress:
                # A counted upload whose download broke inside the model: the recovery adopts
                # a round that holds it (unless it re-joins, which decides for itself).
                self._handed = s.local.progress_counted
                s.recover_snapshot()
        finally:
            self._carried = 0 if self._handed else self._carried + s.local_step
            elapsed = time.monotonic() - t0
            s.metrics["sync_time_s"] += elapsed
            s.metrics["stall_time_s"] += elapsed
            s.local_step = 0
            s.syncing = False
            s.last_step_at = time.monotonic()
            sent, got = s.client.bytes_up - up, s.client.bytes_down - down
            s.metrics["peak_sync_bytes_up"] = max(s.metrics["peak_sync_bytes_up"], sent)
            s.metrics["peak_sync_bytes_down"] = max(s.metrics["peak_sync_bytes_down"], got)
            s.metrics["last_bytes_up"], s.metrics["last_bytes_down"] = sent, got

    def _sync_once(self) -> None:
        s = self._s
        if s.need_rejoin.is_set():
            s.need_rejoin.clear()
            s.rejoin()
            return
        resent = self._unresolved is not None
        submission_id = self._unresolved or uuid.uuid4().hex
        if not resent:
            self._sent_steps = self._carried + s.local_step
        # From the first byte sent the server may count this upload: until it answers, a re-join
        # asks about it, and a failed sync sends the next upload under the same id.
        self._unresolved = self._last_submission = submission_id
        try:
            receipt = UploadReceipt.from_json(self._submit(submission_id))
        except UnknownWorker:
            s.rejoin()  # the server says there whether it holds the upload
            return
        except Conflict as exc:
            if exc.code != "upload_in_progress":  # that one may still be counted
                self._unresolved = self._last_submission = None  # answered: not counted
            s.metrics["refused_submissions"] += 1
            log.info("worker %s: submission refused (%s): %s", s.worker_id, exc.code, exc.detail)
            if exc.reply.action == "rebase":
                s.refresh(counted=False, min_round=exc.reply.round or 0)
            return  # "continue": keep training on the same snapshot; "wait"/"retry": next sync
        self._unresolved = None
        self._counted(resent, receipt)
        self._count_refused(receipt.refused_rounds or ())
        if receipt.refused:  # async: this very update was refused (not finite)
            s.drop_steps(
                self._upload_steps,
                "worker %s: the server refused the update of this upload (%s); its %d local "
                "steps are dropped",
                receipt.refused,
                self._upload_steps,
            )
        if receipt.gated:  # async, past the age gate: acknowledged, nothing applied
            s.drop_steps(
                self._upload_steps,
                "worker %s: the server applied nothing of this upload (%s updates old, past its "
                "age gate); its %d local steps are dropped and the worker adopts version %d",
                receipt.staleness,
                self._upload_steps,
                receipt.result_round,
            )
        if resent and receipt.status == "duplicate":
            # The lost answer was "accepted": those steps are the server's. The steps taken since
            # are mixed into the same local values and cannot be told apart, so they are dropped
            # with them rather than counted a second time.
            since = self._steps_since_sent()
            s.drop_steps(
                since,
                "worker %s: an upload whose answer was lost had been counted in round %s; "
                "the %d local steps taken since are dropped",
                receipt.round,
                since,
            )
        if receipt.late:
            # Its base round closed without it and the server merged it into a later one
            # (quorum rounds): the round that holds it is adopted as any other, not rebased
            # onto, since its steps are already the server's.
            s.metrics["late_merges"] += 1
            log.info(
                "worker %s: upload merged late into round %d (%d round(s) after its base), "
                "weight %s",
                s.worker_id,
                receipt.round,
                receipt.late,
                receipt.weight,
            )
        s.samples = s.tokens = 0.0
        self._await_round(submission_id, receipt.round)
        if receipt.gated:  # its steps are dropped already: a refusal of that round is not ours
            self._adopted_uploads.pop(receipt.round, None)

    def _await_round(self, submission_id: str, counted_round: int) -> None:
        """Adopt the result of the round that counted the upload; if it does not come, the
        progress stays and the next sync sends it again under the same id."""
        s = self._s
        deadline = time.monotonic() + s.settings.max_barrier_wait
        try:
            adopted = s.refresh(counted=True, min_round=counted_round + 1, deadline=deadline)
        except UnknownWorker:
            s.rejoin()  # it asks whether the server still holds the upload
            return
        except SYNC_FAILURES:
            if not s.local.holds_progress:  # the progress is still here: hand it in again
                self._unresolved = submission_id
            raise
        if adopted:
            self._handed = True
            self._last_submission = None
            s.metrics["rounds"] += 1
            log.info(
                "worker %s: round %d closed with this worker's %d steps; now at round %d",
                s.worker_id,
                counted_round,
                self._upload_steps,
                s.base_round,
            )
            self._adopted_uploads[counted_round] = self._upload_steps
            if len(self._adopted_uploads) > 16:  # the server names its last few refusals only
                del self._adopted_uploads[min(self._adopted_uploads)]
        else:
            self._unresolved = submission_id
            log.warning(
                "worker %s: round %d did not close within %.0f s; its upload stays in the model "
                "and goes again under the same id at the next sync",
                s.worker_id,
                counted_round,
                s.settings.max_barrier_wait,
            )

    def _count_refused(self, rounds: tuple[int, ...]) -> None:
        """The server refused these rounds (a result that would not be finite) and discarded
        every upload in them, ours too where we took part: those steps are dropped."""
        for r in rounds:
            steps = self._adopted_uploads.pop(r, None)
            if steps is not None:
                self._s.drop_steps(
                    steps,
                    "worker %s: the server refused round %d (its result would not have been "
                    "finite) and discarded its uploads; this worker's %d local steps in it are "
                    "dropped",
                    r,
                    steps,
                )

    def _final_submit(self) -> None:
        """On exit: hand in the last local steps without waiting for the round to close."""
        s = self._s
        resent = self._unresolved is not None
        try:
            receipt = UploadReceipt.from_json(self._submit(self._unresolved or uuid.uuid4().hex))
        except (Conflict, UnknownWorker) as exc:
            log.warning("worker %s: final submission not counted: %s", s.worker_id, exc.detail)
            return
        self._counted(resent, receipt)
        if resent and receipt.status == "duplicate":  # the earlier upload was held
            since = self._steps_since_sent()
            s.drop_steps(
                since,
                "worker %s: its last upload had been counted; the %d local steps since are dropped",
                since,
            )

    def _steps_since_sent(self) -> int:
        """The model's uncounted local steps beyond those of the first body sent under the
        unresolved id (which the server counted): what a "duplicate" answer drops."""
        return self._carried + self._s.local_step - self._sent_steps
