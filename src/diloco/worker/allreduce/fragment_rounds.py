"""Streaming DiLoCo in all-reduce mode (docs/design.md, "All-reduce mode"): the quorum averages
one fragment at a time, ``sync_every / P`` inner steps apart, while training goes on.

Every member of a quorum must average the same fragment, so the fragment follows from the run's
round, not from each worker's own schedule: round ``r`` averages fragment ``r mod P`` (the
server's plan of ``P`` fragments, ``core.fragments.plan``). The schedule only says when a
worker is ready for its next round. A round that is discarded changes nothing; the next due
point repeats it with the fragment's pseudo-gradient grown by the steps taken since.

Due (training thread): the fragment's pseudo-gradient ``snapshot - local`` is written into a
buffer of one fragment's size, then the round runs:

- ``overlap_steps`` (tau) 0: at once, blocking, and the result is merged before training goes on;
- tau > 0: on a background thread (quorum, average, outer step on the fragment's share of the
  state, hash reported) while training goes on; ``tau`` steps later the training thread merges
  ``local = alpha * local + (1 - alpha) * global`` on the fragment (waiting for the round if it
  is not done: a stall, counted). At most one round is in flight.

The state (snapshot and momentum, whole tensors) is written only by the round's thread while a
round is in flight; the model only by the training thread, except when this worker must receive
the state (a resync): the round's thread then parks the training thread between two steps
(``Park``) for the rebase, and keeps it parked until the state has arrived.

Each fragment has its own outer optimizer over views of the state, like each of the server
mode's units, so a checkpoint has the server mode's streaming layout and a run can move between
the modes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from diloco.core import rebase_
from diloco.core.fragments import Piece, plan
from diloco.core.outer import OuterSGD, apply_outer_step
from diloco.persistence import merge_states
from diloco.worker.allreduce.collective import QuorumFailed, QuorumGroup
from diloco.worker.allreduce.quorum_sync import AllReduceSync, Quorum
from diloco.worker.server_mode.fragment_plan import Schedule
from diloco.worker.session import Session

log = logging.getLogger(__name__)


class Park:
    """Lets the round's thread stop the training thread between two inner steps.

    ``hold`` (round's thread) waits until the training thread is parked; ``release`` lets it go.
    ``serve`` (training thread, between steps) parks while a hold is asked for; ``wait`` is
    where the training thread waits for a round to end, parking too if asked meanwhile."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._wanted = False
        self._parked = False

    @property
    def held(self) -> bool:
        return self._wanted

    def hold(self, timeout: float) -> None:
        """Wait until the training thread is parked; ``QuorumFailed``-worthy ``TimeoutError``
        if it does not come within ``timeout`` seconds (a step longer than that)."""
        with self._cond:
            if self._wanted:
                return
            self._wanted = True
            self._cond.notify_all()
            if not self._cond.wait_for(lambda: self._parked, timeout):
                self._wanted = False
                self._cond.notify_all()
                raise TimeoutError(f"the training loop did not pause within {timeout:.0f} s")

    def release(self) -> None:
        with self._cond:
            self._wanted = False
            self._cond.notify_all()

    def serve(self) -> None:
        """Park here while the round's thread holds the model."""
        with self._cond:
            self._park_if_asked()

    def wait(self, done: threading.Event) -> None:
        """Until ``done`` is set (the round's thread sets it through ``notify``), parking
        whenever asked."""
        with self._cond:
            while not done.is_set():
                if not self._park_if_asked():
                    self._cond.wait()

    def notify(self, done: threading.Event) -> None:
        with self._cond:
            done.set()
            self._cond.notify_all()

    def _park_if_asked(self) -> bool:
        if not self._wanted:
            return False
        self._parked = True
        self._cond.notify_all()
        self._cond.wait_for(lambda: not self._wanted)
        self._parked = False
        return True


@dataclass
class Round:
    """One fragment's round on the background thread."""

    fragment: int
    apply_at: int  # the total step count after which the training thread merges
    done: threading.Event = field(default_factory=threading.Event)
    completed: bool = False  # a quorum averaged this worker's contribution


class StreamingAllReduceSync(AllReduceSync):
    """The ``SyncStrategy`` of all-reduce mode with ``num_fragments > 1``."""

    def __init__(self, session: Session, reply: Mapping[str, Any]) -> None:
        settings = session.settings
        self._plan: list[list[Piece]] = plan(
            session.local.table(), settings.num_fragments, settings.fragment_pattern
        )
        super().__init__(session, reply)
        self.alpha = settings.merge_alpha
        self.tau = settings.overlap_steps
        self.schedule = Schedule(session.sync_every, len(self._plan))
        snapshot, momentum = session.local.snapshot, self._momentum
        names = list(snapshot)
        # One outer optimizer per fragment over views of the state (the server's units).
        self._views: list[list[torch.nn.Parameter]] = []
        self._outers: list[OuterSGD] = []
        group = self._outer.param_groups[0]
        for pieces in self._plan:
            views = [
                torch.nn.Parameter(
                    snapshot[p.param].view(-1)[p.start : p.stop].view(p.shape),
                    requires_grad=False,
                )
                for p in pieces
            ]
            outer = OuterSGD(
                views, lr=group["lr"], momentum=group["momentum"], nesterov=group["nesterov"]
            )
            if momentum:
                for view, p in zip(views, pieces, strict=True):
                    buf = momentum[names.index(p.param)].view(-1)[p.start : p.stop]
                    outer.state[view]["momentum_buffer"] = buf.view(p.shape)
            self._views.append(views)
            self._outers.append(outer)
        self._park = Park()
        self._inflight: Round | None = None
        self._thread: threading.Thread | None = None
        self._leaving = threading.Event()
        self._filled = -1  # the fragment whose pseudo-gradient the buffer holds (-1: none)
        self._fill_weight = 0.0
        self._fill_mark = (0, 0.0)
        # Per fragment: the total steps and samples when its last contribution was taken.
        self._marks = [(session.total_steps, session.samples)] * len(self._plan)

    # --- SyncStrategy -------------------------------------------------------------------------

    def after_step(self) -> None:
        s = self._s
        self._park.serve()
        job = self._inflight
        if job is not None and s.total_steps >= job.apply_at:
            self._finish(job)
        due = self.schedule.advance()
        s.local_step = self.schedule.phase
        if due is not None:
            self._start()

    def sync_now(self) -> None:
        """The next round at once, blocking (after the one in flight, if any)."""
        if self._inflight is not None:
            self._finish(self._inflight)
        self._fill(self._s.base_round % len(self._plan))
        self._sync()

    def finish(self, *, submit: bool) -> None:
        """Let the round in flight end and merge it; nothing is handed in after that (only a
        quorum averages)."""
        self._leaving.set()
        if self._inflight is not None:
            self._finish(self._inflight)
        super().finish(submit=submit)

    # --- the training thread ------------------------------------------------------------------

    def _start(self) -> None:
        s = self._s
        if self._inflight is not None:  # at most one round in flight
            self._finish(self._inflight)
        self._fill(s.base_round % len(self._plan))
        if self.tau == 0:
            self._sync()
            return
        job = Round(self._filled, s.total_steps + self.tau)
        self._inflight = job
        self._thread = threading.Thread(
            target=self._run, args=(job,), name="diloco-allreduce-round", daemon=True
        )
        self._thread.start()

    def _finish(self, job: Round) -> None:
        """Wait for the round (a stall if it is not done), then merge its fragment."""
        s = self._s
        if not job.done.is_set():
            s.metrics["stalls"] += 1
            t0 = time.monotonic()
            s.syncing = True
            self._park.wait(job.done)
            s.syncing = False
            s.metrics["stall_time_s"] += time.monotonic() - t0
        self._inflight = None
        if job.completed:
            self._merge(job.fragment, self.alpha)

    def _fill(self, k: int) -> None:
        """Fragment ``k``'s pseudo-gradient into the buffer, with its weight (training thread,
        or the round's thread while the training thread is parked)."""
        s = self._s
        steps, samples = self._marks[k]
        flat, offset = self._acc[0], 0
        with torch.no_grad():
            for piece in self._plan[k]:
                local, snapshot = s.local.slices(piece)
                out = flat[offset : offset + piece.numel]
                torch.sub(snapshot, local.to(flat.device), out=out)
                offset += piece.numel
        new_steps = s.total_steps - steps
        if new_steps <= 0:
            self._fill_weight = 0.0  # nothing since its last contribution
        elif self._samples_weighting:  # as the plain strategy: steps when no samples reported
            self._fill_weight = s.samples - samples if s.samples > samples else float(new_steps)
        else:
            self._fill_weight = 1.0
        self._fill_mark = (s.total_steps, s.samples)
        self._filled = k

    def _merge(self, k: int, alpha: float) -> None:
        """``local = alpha * local + (1 - alpha) * global`` on fragment ``k`` (0: adopt)."""
        local = self._s.local
        with torch.no_grad():
            for piece in self._plan[k]:
                mine, snapshot = local.slices(piece)
                fresh = snapshot.to(mine.device, non_blocking=True)
                if alpha == 0:
                    mine.copy_(fresh)
                else:
                    mine.mul_(alpha).add_(fresh.to(mine.dtype), alpha=1 - alpha)
            local.settle_copies()

    # --- the round (training thread when tau is 0, else the round's thread) -------------------

    @property
    def _background(self) -> bool:
        """This code runs on the round's thread (the training thread may be stepping)."""
        return threading.current_thread() is self._thread

    def _run(self, job: Round) -> None:
        try:
            job.completed = self._attempts()
        except Exception:  # a bug must not leave the training loop waiting forever
            log.exception("worker %s: all-reduce round crashed", self._s.worker_id)
        finally:
            if self._park.held:
                self._park.release()
            self._park.notify(job.done)

    def _synced(self) -> None:
        k = self._filled
        self._marks[k] = self._fill_mark
        if not self._background:  # inline: merge before training goes on
            self._merge(k, self.alpha)
        # ``samples`` stays cumulative here: each fragment's weight is its difference since
        # that fragment's last contribution (``_marks``).

    def _given_up(self) -> bool:
        return self._leaving.is_set()

    def _round(self, q: Quorum, weighted: bool) -> tuple[int, str]:
        try:
            return super()._round(q, weighted)
        finally:
            if self._park.held and not self._needs_state:
                self._park.release()

    def _share_state(self, group: QuorumGroup, q: Quorum) -> None:
        if q.rank in q.resync and self._background:
            try:  # the rebase changes the model: the training loop waits meanwhile
                self._park.hold(q.timeout)
            except TimeoutError as exc:
                raise QuorumFailed(q.id, str(exc)) from exc
        super()._share_state(group, q)

    def _settle_counted(self, q: Quorum, steps_then: int) -> None:
        """Only the fragment of the round that made the state was counted: its progress goes,
        the other fragments keep theirs (a rebase)."""
        s = self._s
        s.local.each_param(rebase_)
        k = (q.round - 1) % len(self._plan)
        self._marks[k] = (s.total_steps, s.samples)  # its progress is counted
        self._merge(k, 0.0)
        log.warning(
            "worker %s: its part of fragment %d's failed round is in the run's state; the "
            "fragment takes that state",
            s.worker_id,
            k,
        )

    def _contribute(self, group: QuorumGroup, q: Quorum, weighted: bool) -> float:
        k = q.round % len(self._plan)
        if k != self._filled or q.rank in q.resync:
            # The state changed under the buffer (a rebase) or the run is at another round
            # than this worker was: the pseudo-gradient is taken again, the model parked.
            if self._background:
                try:
                    self._park.hold(q.timeout)
                except TimeoutError as exc:
                    raise QuorumFailed(q.id, str(exc)) from exc
            self._fill(k)
        size = sum(p.numel for p in self._plan[k])
        flat = self._acc[0][:size]
        weight = self._fill_weight if weighted else 0.0
        if weight == 0.0:
            flat.zero_()  # nothing to add; finite bytes whatever the buffer held
        return self._average(group, q, [flat], weight)

    def _step(self, q: Quorum) -> None:
        k = q.round % len(self._plan)
        flat, offset = self._acc[0], 0
        grads = []
        for piece in self._plan[k]:
            grads.append(flat[offset : offset + piece.numel].view(piece.shape))
            offset += piece.numel
        apply_outer_step(self._outers[k], self._views[k], grads)

    def _buffers(self) -> list[torch.Tensor]:
        """One buffer of the largest fragment's size, fp32."""
        largest = max(sum(p.numel for p in frag) for frag in self._plan)
        return [torch.zeros(largest, dtype=torch.float32)]

    def _checkpoint_state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The server mode's streaming layout: one unit per fragment, each with its round (the
        rounds of the run that averaged it) and its optimizer's state."""
        state, shape = merge_states(list(self._outers))
        n, r = len(self._plan), self._s.base_round
        return state, {
            "fragments": [n, self._s.settings.fragment_pattern],
            "unit_rounds": [(r - k + n - 1) // n for k in range(n)],
            "optimizer_units": shape,
        }
