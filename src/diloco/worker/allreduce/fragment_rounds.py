"""Streaming DiLoCo in all-reduce mode (docs/design/allreduce.md), the quorum loop's
second payload: the quorum averages one fragment at a time, ``sync_every / P`` inner steps apart,
while training goes on.

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
from dataclasses import dataclass, field
from typing import Any

import torch

from diloco.core import rebase_
from diloco.core.fragments import Piece, Schedule, plan
from diloco.core.outer import OuterSGD, apply_outer_step
from diloco.persistence import merge_states
from diloco.wire.messages import Assignment
from diloco.worker.allreduce.collective import QuorumFailed
from diloco.worker.allreduce.park import Park
from diloco.worker.allreduce.payload import Rounds
from diloco.worker.allreduce.shared_state import SharedState
from diloco.worker.session import Session

log = logging.getLogger(__name__)


@dataclass
class Round:
    """One fragment's round on the background thread."""

    fragment: int
    apply_at: int  # the total step count after which the training thread merges
    done: threading.Event = field(default_factory=threading.Event)
    completed: bool = False  # a quorum averaged this worker's contribution


class FragmentRounds:
    """The ``Payload`` of ``num_fragments > 1``: one outer optimizer per fragment."""

    def __init__(self, session: Session, state: SharedState) -> None:
        settings = session.settings
        self._s = session
        self._plan: list[list[Piece]] = plan(
            session.local.table(), settings.num_fragments, settings.fragment_pattern
        )
        self._by_samples = state.rules.by_samples
        self.alpha = settings.merge_alpha
        self.tau = settings.overlap_steps
        self.schedule = Schedule(session.sync_every, len(self._plan))
        # One outer optimizer per fragment over views of the state (the server's units).
        self._views: list[list[torch.nn.Parameter]] = []
        self._outers: list[OuterSGD] = []
        self._build_outers(state)
        # One buffer of the largest fragment's size, fp32, where a fragment is averaged.
        largest = max(sum(p.numel for p in frag) for frag in self._plan)
        self._acc = torch.zeros(largest, dtype=torch.float32)
        self._park = Park()
        self._inflight: Round | None = None
        self._thread: threading.Thread | None = None
        self._filled = -1  # the fragment whose pseudo-gradient the buffer holds (-1: none)
        self._fill_weight = 0.0
        self._fill_mark = (0, 0.0)
        # The checks left this worker's last round out: the merge takes the whole state.
        self._left_out = False
        # Per fragment: the total steps and samples when its last contribution was taken.
        self._marks = [(session.total_steps, session.samples)] * len(self._plan)
        #: Parameters outside the round's fragment moved (a state taken, a rebase): a worker
        #: group's rank 0 then shares the whole model (``allreduce/group_rounds.py`` clears it).
        self.moved_all = False

    def _build_outers(self, state: SharedState) -> None:
        snapshot, momentum = state.snapshot, state.momentum
        names = list(snapshot)
        for pieces in self._plan:
            views = [
                torch.nn.Parameter(
                    snapshot[p.param].view(-1)[p.start : p.stop].view(p.shape),
                    requires_grad=False,
                )
                for p in pieces
            ]
            buffers = [
                momentum[names.index(p.param)].view(-1)[p.start : p.stop].view(p.shape)
                for p in pieces
                if momentum
            ]
            self._views.append(views)
            self._outers.append(state.outer(views, buffers))

    # --- the schedule (training thread) -------------------------------------------------------

    def after_step(self, rounds: Rounds) -> None:
        s = self._s
        self._park.serve()
        job = self._inflight
        if job is not None and s.total_steps >= job.apply_at:
            self._finish(job)
        due = self.schedule.advance()
        s.local_step = self.schedule.phase
        if due is not None:
            self._start(rounds)

    def sync_now(self, rounds: Rounds) -> None:
        """The next round at once, blocking (after the one in flight, if any)."""
        if self._inflight is not None:
            self._finish(self._inflight)
        self._fill(self._s.base_round % len(self._plan))
        rounds.sync()

    def leave(self) -> None:
        """Let the round in flight end and merge it."""
        if self._inflight is not None:
            self._finish(self._inflight)

    # --- a worker group's rank 0 (allreduce/group_rounds.py) ---------------------------------

    @property
    def num_fragments(self) -> int:
        return len(self._plan)

    @property
    def inflight(self) -> Round | None:
        return self._inflight

    @property
    def filled(self) -> int:
        """The fragment whose pseudo-gradient the buffer holds (-1: none yet)."""
        return self._filled

    def fragment_params(self, k: int) -> list[str]:
        return list(dict.fromkeys(p.param for p in self._plan[k]))

    def start(self, rounds: Rounds) -> None:
        """The due point's round (``after_step`` without its schedule)."""
        self._start(rounds)

    def finish_round(self, job: Round) -> None:
        self._finish(job)

    def _start(self, rounds: Rounds) -> None:
        s = self._s
        if self._inflight is not None:  # at most one round in flight
            self._finish(self._inflight)
        self._fill(s.base_round % len(self._plan))
        if self.tau == 0:
            rounds.sync()
            return
        job = Round(self._filled, s.total_steps + self.tau)
        self._inflight = job
        self._thread = threading.Thread(
            target=self._run, args=(job, rounds), name="diloco-allreduce-round", daemon=True
        )
        self._thread.start()

    def _finish(self, job: Round) -> None:
        """Wait for the round (a stall if it is not done), then merge its fragment."""
        s = self._s
        if not job.done.is_set():
            s.stall(lambda: self._park.wait(job.done))
        self._inflight = None
        if job.completed:
            self._merge_round(job.fragment)

    def _fill(self, k: int) -> None:
        """Fragment ``k``'s pseudo-gradient into the buffer, with its weight (training thread,
        or the round's thread while the training thread is parked)."""
        s = self._s
        flat, offset = self._acc, 0
        with torch.no_grad():
            for piece in self._plan[k]:
                self._fill_piece(piece, flat[offset : offset + piece.numel])
                offset += piece.numel
        self._fill_weight = self._weight_of(k)
        self._fill_mark = (s.total_steps, s.samples)
        self._filled = k

    def _fill_piece(self, piece: Piece, out: torch.Tensor) -> None:
        local, snapshot = self._s.local.slices(piece)
        torch.sub(snapshot, local.to(out.device), out=out)

    def _weight_of(self, k: int) -> float:
        """Fragment ``k``'s weight: what was trained since its last contribution."""
        s = self._s
        steps, samples = self._marks[k]
        new_steps = s.total_steps - steps
        if new_steps <= 0:
            return 0.0  # nothing since its last contribution
        if self._by_samples:  # as the plain strategy: steps when no samples reported
            return s.samples - samples if s.samples > samples else float(new_steps)
        return 1.0

    def _merge_round(self, k: int) -> None:
        """A completed round's merge: fragment ``k`` by ``alpha``, or, when the checks left this
        worker out, the whole model takes the state (training thread)."""
        if not self._left_out:
            self._merge(k, self.alpha)
            return
        self._left_out = False
        s = self._s
        dropped = s.total_steps - min(steps for steps, _ in self._marks)
        for j in range(len(self._plan)):
            self._merge(j, 0.0)
        self._marks = [(s.total_steps, s.samples)] * len(self._plan)
        s.drop_steps(
            dropped,
            "worker %s: its part of fragment %d's round was left out; the model takes the "
            "run's state and drops %d steps of progress",
            k,
            dropped,
        )

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

    # --- one round (training thread when tau is 0, else the round's thread) -------------------

    @property
    def _background(self) -> bool:
        """This code runs on the round's thread (the training thread may be stepping)."""
        return threading.current_thread() is self._thread

    def _run(self, job: Round, rounds: Rounds) -> None:
        try:
            job.completed = rounds.attempts()
        except Exception:  # a bug must not leave the training loop waiting forever
            log.exception("worker %s: all-reduce round crashed", self._s.worker_id)
        finally:
            if self._park.held:
                self._park.release()
            self._park.notify(job.done)

    def _hold_model(self, q: Assignment) -> None:
        """On the round's thread: park the training thread (``QuorumFailed`` if it does not
        come within the quorum's timeout). On the training thread: nothing to wait for."""
        if self._background:
            try:
                self._park.hold(q.timeout)
            except TimeoutError as exc:
                raise QuorumFailed(q.quorum_id, str(exc)) from exc

    def receiving_state(self, q: Assignment) -> None:
        self.moved_all = True
        self._hold_model(q)  # the rebase changes the model: the training loop waits meanwhile

    def contribution(self, q: Assignment, weighted: bool) -> tuple[list[torch.Tensor], float]:
        k = q.round % len(self._plan)
        if k != self._filled or q.receiving:
            # The state changed under the buffer (a rebase) or the run is at another round
            # than this worker was: the pseudo-gradient is taken again, the model parked.
            self._hold_model(q)
            self._fill(k)
        size = sum(p.numel for p in self._plan[k])
        flat = self._acc[:size]
        weight = self._fill_weight if weighted else 0.0
        if weight == 0.0:
            flat.zero_()  # nothing to add; finite bytes whatever the buffer held
        return [flat], weight

    def weight_now(self, weighted: bool) -> float:
        return self._weight_of(self._s.base_round % len(self._plan)) if weighted else 0.0

    def left_out(self, q: Assignment) -> None:
        self.moved_all = True
        self._left_out = True  # the model is the training thread's: taken at the merge

    def step(self, q: Assignment) -> None:
        k = q.round % len(self._plan)
        flat, offset = self._acc, 0
        grads = []
        for piece in self._plan[k]:
            grads.append(flat[offset : offset + piece.numel].view(piece.shape))
            offset += piece.numel
        apply_outer_step(self._outers[k], self._views[k], grads)

    def round_ended(self, *, has_state: bool) -> None:
        if self._park.held and has_state:
            self._park.release()

    def completed(self) -> None:
        k = self._filled
        if not self._left_out:  # a part left out was not contributed: the merge counts it
            self._marks[k] = self._fill_mark
        if not self._background:  # inline: merge before training goes on
            self._merge_round(k)
        # ``samples`` stays cumulative here: each fragment's weight is its difference since
        # that fragment's last contribution (``_marks``).

    def settle_counted(self, q: Assignment, steps_then: int) -> None:
        """Only the fragment of the round that made the state was counted: its progress goes,
        the other fragments keep theirs (a rebase)."""
        s = self._s
        self.moved_all = True
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

    def take_state(self) -> None:
        """Every fragment takes the state received; the steps since the oldest fragment's last
        contribution are dropped (counted once: a left-out merge reset the marks), and every
        fragment's mark starts again, so no fragment's next weight counts them. ``samples``
        stays cumulative (the marks hold it)."""
        s = self._s
        self.moved_all = True
        s.local.adopt_all()
        dropped = s.total_steps - min(steps for steps, _ in self._marks)
        self._marks = [(s.total_steps, s.samples)] * len(self._plan)
        self._left_out = False  # the whole model took the state: no merge of it is left to do
        s.drop_steps(
            dropped, "worker %s: rejoined with the run's state (%d local steps dropped)", dropped
        )

    def checkpoint_state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The server mode's streaming layout: one unit per fragment, each with its round (the
        rounds of the run that averaged it) and its optimizer's state."""
        state, shape = merge_states(list(self._outers))
        n, r = len(self._plan), self._s.base_round
        return state, {
            "fragments": [n, self._s.settings.fragment_pattern],
            "unit_rounds": [(r - k + n - 1) // n for k in range(n)],
            "optimizer_units": shape,
        }
