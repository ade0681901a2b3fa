"""Streaming DiLoCo on the worker (arXiv 2501.18512): the model syncs one fragment at a time.

A fragment is a list of flat element ranges of parameters, planned by the server. Fragment ``f``
is due after inner step ``sync_offsets(H, P)[f]`` of every period of ``H`` steps. When it is due,
its pseudo-gradient ``snapshot - local`` is written into a send buffer (1/P of the model) and a
background thread (``FragmentSender``) uploads it and long-polls the fragment's new global values
into a receive buffer (1/P of the model, fp32), while the training loop goes on. ``tau`` steps
after it was sent the result is merged: ``local = alpha * local + (1 - alpha) * global``,
``snapshot = global``.

Only one exchange is in flight. A fragment that comes due while the previous one is still out
waits for it (a stall, counted). Fragments are disjoint, so a merge never touches the elements of
another fragment's pending pseudo-gradient.

The full snapshot keeps the layout of a full download, so joining and re-joining work exactly as
in plain DiLoCo (the worker's lifecycle); only the fragment rounds and plan are added here.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Mapping

import torch

from diloco.core.fragments import Piece, Schedule, plan
from diloco.core.piece_moves import ADD, MERGE, REBASE
from diloco.core.pseudo_gradient import PIECE
from diloco.wire.messages import ParamsSeeded, Registered, UploadReceipt
from diloco.worker.server_mode.fragment_exchange import Exchange, FragmentSender
from diloco.worker.server_mode.fragment_plan import plan_from_server
from diloco.worker.server_mode.joining import (
    JoinAnswer,
    join_server,
    note_lost_adoption,
    rejoin_server,
)
from diloco.worker.session import Session
from diloco.worker.transport.client import SYNC_FAILURES, Conflict, UnknownWorker

log = logging.getLogger(__name__)


class StreamingSync:
    """The ``SyncStrategy`` of ``num_fragments > 1``."""

    def __init__(self, session: Session) -> None:
        self._s = session
        settings = session.settings
        self.alpha = settings.merge_alpha
        self.tau = settings.overlap_steps
        self.pattern = settings.fragment_pattern
        self.plan: list[list[Piece]] = []
        self.rounds: list[int] = []
        self.schedule = Schedule(settings.sync_every, settings.num_fragments)
        self._sender = FragmentSender(session)
        self._sent_step: list[int] = []  # total step count when each fragment was last sent
        self._sent_samples: list[float] = []
        self._sent_tokens: list[float] = []
        self._send_views: list[dict[str, torch.Tensor]] = []
        self._scratch: torch.Tensor | None = None
        self._inflight: Exchange | None = None
        self._uncounted_drop: Exchange | None = None  # counted upload whose result never came
        # Per fragment, an upload whose every answer was lost: the server may have counted it,
        # so the fragment's next upload goes under the same id (a duplicate if it had).
        self._unresolved: dict[int, str] = {}
        # A counted upload whose result never came (the server forgot this worker): the re-join
        # asks about it.
        self._last_submission: str | None = None

    # --- SyncStrategy: joining ----------------------------------------------------------------

    @property
    def last_submission(self) -> str | None:
        return self._last_submission

    @property
    def round(self) -> int:
        return min(self.rounds) if self.rounds else self._s.base_round  # the furthest behind

    def join(self, reply: Registered) -> None:
        join_server(self._s, self, reply)

    def rejoin(self, reply: Registered) -> str:
        return rejoin_server(self._s, self, reply)

    # --- Joining (server_mode/joining.py) -----------------------------------------------------

    def configure(self, reply: Registered | ParamsSeeded) -> None:
        if reply.fragments is not None:
            self._set_plan(plan_from_server(reply.fragments, self._s.local.table()))
        if reply.fragment_rounds is not None:
            self.rounds = list(reply.fragment_rounds)

    def joined(self, metadata: Mapping[str, str]) -> None:
        """A full download's metadata holds every fragment's round."""
        s = self._s
        raw = metadata.get("fragment_rounds")
        if raw is None:
            raise ValueError(
                "the server runs plain DiLoCo (its parameters carry no fragment rounds); "
                f"use num_fragments=1 or start it for {s.settings.num_fragments} fragments"
            )
        if not self.plan:
            # It joined a server that had no parameters yet and another worker seeded them.
            log.info("worker %s: planning fragments as the server does", s.worker_id)
            self._set_plan(plan(s.local.table(), s.settings.num_fragments, self.pattern))
        rounds = [int(r) for r in raw.split(",")]
        if len(rounds) != len(self.plan):
            raise ValueError(
                f"the server has {len(rounds)} fragment rounds for a plan of {len(self.plan)}"
            )
        self.rounds = rounds

    def rejoined(self, answer: JoinAnswer) -> str:
        resend = self._last_submission if answer.held_open and not answer.seeded else None
        note_lost_adoption(self._s, answer, resend, 0)  # no whole-model upload is adopted here
        if self._uncounted_drop is not None:
            job = self._uncounted_drop
            if answer.in_params:  # only that fragment's progress is in the served parameters
                self._drop_sent(job.fragment)
                self._uncounted_drop = None
            elif resend is not None:
                # Held in a round still open (in memory only): its progress stays, and the
                # fragment's next upload goes under its id.
                self._unresolved[job.fragment] = job.submission_id
                self._uncounted_drop = None
        self._s.refresh(counted=answer.seeded, min_round=0)
        self.joined(self._s.last_metadata)
        self._last_submission = None
        return "counted" if answer.seeded else "kept locally"

    def _set_plan(self, new_plan: list[list[Piece]]) -> None:
        s = self._s
        if new_plan == self.plan:
            return
        if self._inflight is not None:
            raise RuntimeError("the fragment plan changed while a fragment was in flight")
        if len(new_plan) != self.schedule.num_fragments:
            log.warning(
                "worker %s: the server plans %d fragments, this worker was set for %d",
                s.worker_id,
                len(new_plan),
                self.schedule.num_fragments,
            )
            if len(new_plan) > s.sync_every:
                raise ValueError(f"{len(new_plan)} fragments need sync_every >= {len(new_plan)}")
            self.schedule = Schedule(s.sync_every, len(new_plan))
        for name, param in s.local.params.items():
            if not param.data.is_contiguous():
                raise ValueError(f"streaming needs contiguous parameters; {name!r} is not")
        self.plan = new_plan
        comm = torch.bfloat16 if s.local.comm_dtype == "BF16" else torch.float32
        largest = max(sum(p.numel for p in frag) for frag in new_plan)
        send = torch.empty(largest, dtype=comm)
        self._send_views = []
        for frag in new_plan:
            views, offset = {}, 0
            for p in frag:
                views[p.wire_name] = send[offset : offset + p.numel]
                offset += p.numel
            self._send_views.append(views)
        self._sender.recv = torch.empty(largest * 4, dtype=torch.uint8)
        self._sent_step = [s.total_steps] * len(new_plan)
        self._sent_samples = [s.samples] * len(new_plan)
        self._sent_tokens = [s.tokens] * len(new_plan)

    # --- SyncStrategy: the training thread ----------------------------------------------------

    def after_step(self) -> None:
        s = self._s
        t0 = time.monotonic()
        busy = False
        job = self._inflight
        if job is not None and s.total_steps >= job.apply_at:
            self._finish(job)
            busy = True
        due = self.schedule.advance()
        s.local_step = self.schedule.phase
        if due is not None:
            busy = True
            if s.need_rejoin.is_set():
                self._rejoin()
            else:
                self._send(due)
                if self.tau == 0:
                    assert self._inflight is not None
                    self._finish(self._inflight)
        if self.schedule.phase == 0:
            self._retime()
        if busy:
            s.metrics["sync_time_s"] += time.monotonic() - t0
            s.last_step_at = time.monotonic()

    def sync_now(self) -> None:
        """Every fragment in turn, each merged before the next is sent."""
        if self._s.need_rejoin.is_set():
            self._rejoin()
            return
        for k in range(len(self.plan)):
            self._send(k)
            assert self._inflight is not None
            self._finish(self._inflight)

    def finish(self, *, submit: bool) -> None:
        """Let the exchange in flight end (after its current poll), then hand in every
        fragment's steps since it was last sent."""
        self._sender.abandon.set()
        if self._inflight is not None:
            self._finish(self._inflight)
        try:
            if submit and not self._s.need_rejoin.is_set():
                for k in range(len(self.plan)):
                    if self._s.total_steps > self._sent_step[k]:
                        self._final_submit(k)
        finally:
            self._sender.close()

    # --- a worker group's rank 0: worker/groups/group_streaming.py drives these -------------

    def wants_rejoin(self) -> bool:
        return self._s.need_rejoin.is_set()  # the due fragment re-joins instead

    def due_params(self, k: int) -> list[str]:
        return list(dict.fromkeys(p.param for p in self.plan[k]))

    def send_fragment(self, k: int) -> None:
        self._send(k)

    def merge_inflight(self) -> tuple[str, bool]:
        """Wait for the exchange in flight, apply it: (its outcome, False: nothing else moved)."""
        job = self._inflight
        if job is not None:
            self._finish(job)
        return ("none" if job is None else job.outcome), False

    def rejoin_now(self) -> None:
        self._rejoin()

    def abandon(self) -> None:
        self._sender.abandon.set()

    def _retime(self) -> None:
        """Between periods: follow ``sync_every`` if DyLU changed it (the heartbeat thread sets
        it at any time; the schedule takes it only at a period boundary)."""
        sync_every = max(self._s.sync_every, len(self.plan))
        if sync_every != self.schedule.sync_every:
            self.schedule.retime(sync_every)

    def _fill(self, k: int) -> None:
        """Write fragment ``k``'s pseudo-gradient into the send buffer (rounded after the fp32
        subtraction)."""
        if self._scratch is None:
            self._scratch = torch.empty(PIECE, dtype=torch.float32)
        for piece in self.plan[k]:
            self._s.local.fill_piece(piece, self._send_views[k][piece.wire_name], self._scratch)

    def _send(self, k: int) -> None:
        s = self._s
        if self._inflight is not None:  # at most one exchange in flight
            self._finish(self._inflight)
        self._fill(k)
        steps = s.total_steps - self._sent_step[k]
        samples = s.samples - self._sent_samples[k]
        tokens = s.upload_tokens(s.tokens - self._sent_tokens[k])
        self._sent_step[k] = s.total_steps
        self._sent_samples[k] = s.samples
        self._sent_tokens[k] = s.tokens
        resent = k in self._unresolved
        job = Exchange(
            fragment=k,
            base_round=self.rounds[k],
            submission_id=self._submission_id(k),
            weight=samples if samples > 0 else float(max(steps, 1)),
            tokens=tokens,
            apply_at=s.total_steps + self.tau,
            pieces=self.plan[k],
            send=self._send_views[k],
            resent=resent,
            steps=steps,
        )
        self._inflight = job
        self._sender.send(job)
        s.metrics["fragments_sent"] += 1

    def _finish(self, job: Exchange) -> None:
        """Wait for the exchange (a stall if it is not back yet), then apply its outcome."""
        s = self._s
        if not job.done.is_set():
            s.stall(job.done.wait)
        self._inflight = None
        self._apply(job)

    def _apply(self, job: Exchange) -> None:
        s, k = self._s, job.fragment
        metrics = s.metrics
        metrics["peak_sync_bytes_up"] = max(metrics["peak_sync_bytes_up"], job.bytes_up)
        metrics["peak_sync_bytes_down"] = max(metrics["peak_sync_bytes_down"], job.bytes_down)
        metrics["last_bytes_up"], metrics["last_bytes_down"] = job.bytes_up, job.bytes_down
        with torch.no_grad():
            if job.outcome == "merge":
                for piece in self.plan[k]:
                    s.local.move_piece(piece, MERGE, job.received[piece.wire_name], self.alpha)
                self.rounds[k] = job.new_round
                metrics["rounds"] += 1
            elif job.outcome == "rebase":  # keep the local progress on top of the new values
                for piece in self.plan[k]:
                    s.local.move_piece(piece, REBASE, job.received[piece.wire_name], 0.0)
                self.rounds[k] = job.new_round
                metrics["rebases"] += 1
                metrics["refused_submissions"] += 1
            elif job.outcome == "keep":
                metrics["refused_submissions"] += 1
            elif job.outcome in ("failed", "timeout"):
                metrics["failed_syncs"] += 1
                if job.unanswered or job.counted:
                    # Counted or maybe counted, but its round never came: the server may have
                    # lost it with a crash, so the progress stays in the model and the
                    # fragment's next upload goes under the same id ("duplicate" if it holds it).
                    self._unresolved[k] = job.submission_id
            elif job.outcome == "rejoin":
                s.need_rejoin.set()
                if job.counted:
                    self._uncounted_drop = job
                    self._last_submission = job.submission_id
            s.local.settle_copies()
        if job.outcome == "merge" and job.duplicate:
            # The server already held an earlier upload under this id: the fragment's steps
            # since then are mixed into the same values and are dropped with the merge.
            s.drop_steps(
                job.steps,
                "worker %s: fragment %d's earlier upload had been counted; its %d local steps "
                "since are dropped",
                k,
                job.steps,
            )
        if job.outcome == "merge" and job.gated:
            s.drop_steps(
                job.steps,
                "worker %s: the server applied nothing of fragment %d's upload (past its age "
                "gate); its %d local steps are dropped with the merge",
                k,
                job.steps,
            )
        if job.outcome != "merge":
            log.info("worker %s: fragment %d %s %s", s.worker_id, k, job.outcome, job.detail)

    def _drop_sent(self, k: int) -> None:
        """Remove the sent pseudo-gradient's progress from the model, keeping later steps:
        ``local + (snapshot - local_then)``."""
        for piece in self.plan[k]:
            self._s.local.move_piece(piece, ADD, self._send_views[k][piece.wire_name], 0.0)

    def _rejoin(self) -> None:
        s = self._s
        if self._inflight is not None:
            self._finish(self._inflight)
        s.need_rejoin.clear()
        try:
            s.rejoin()
        except SYNC_FAILURES as exc:
            s.metrics["failed_syncs"] += 1
            s.need_rejoin.set()  # tried again when the next fragment is due
            log.warning("worker %s: re-join failed, training on locally: %s", s.worker_id, exc)
            if s.local.holds_progress:
                s.recover_snapshot()
        finally:
            self._uncounted_drop = None

    def _submission_id(self, k: int) -> str:
        """The id of fragment ``k``'s next upload: the unanswered one's again, if there is one."""
        return self._unresolved.pop(k, "") or uuid.uuid4().hex

    def _final_submit(self, k: int) -> None:
        s = self._s
        assert s.worker_id is not None
        self._fill(k)
        resent = k in self._unresolved
        body = s.encoder.fragment_upload(self.plan[k], self._send_views[k])
        try:
            reply = s.client.submit_pseudogradients(
                s.worker_id,
                self.rounds[k],
                self._submission_id(k),
                body.specs,
                body.produce,
                weight=float(s.total_steps - self._sent_step[k]),
                tokens=s.tokens - self._sent_tokens[k] if s.reports_tokens else None,
                fragment=k,
                codec=s.encoder.metadata,
            )
            if not (resent and UploadReceipt.from_json(reply).status == "duplicate"):
                body.commit()
            s.metrics["fragments_sent"] += 1
        except (Conflict, UnknownWorker) as exc:
            log.warning(
                "worker %s: final submission of fragment %d not counted: %s",
                s.worker_id,
                k,
                exc.detail,
            )
