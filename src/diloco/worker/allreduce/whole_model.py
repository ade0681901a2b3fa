"""All-reduce mode's plain payload: the whole model every ``sync_every`` inner steps, on the
training thread, which waits for the round. Memory: the model, the snapshot, the momentum and
one averaging buffer of the model's size (4 models fp32)."""

from __future__ import annotations

import logging
from typing import Any

import torch

from diloco.core.fragments import SEQUENTIAL
from diloco.core.outer import apply_outer_step
from diloco.wire.messages import Assignment
from diloco.worker.allreduce.payload import Rounds
from diloco.worker.allreduce.shared_state import SharedState
from diloco.worker.session import Session

log = logging.getLogger(__name__)


class WholeModel:
    """The ``Payload`` of ``num_fragments == 1``: one outer optimizer over the whole state."""

    def __init__(self, session: Session, state: SharedState) -> None:
        self._s = session
        self._state = state
        self._outer = state.outer(state.globals, state.momentum)
        # Where the pseudo-gradient is averaged: one model's worth, fp32.
        self._acc = [torch.empty_like(t) for t in state.snapshot.values()]

    # --- the schedule -------------------------------------------------------------------------

    def after_step(self, rounds: Rounds) -> None:
        s = self._s
        if s.local_step >= s.sync_every or s.need_rejoin.is_set():
            rounds.sync()

    def sync_now(self, rounds: Rounds) -> None:
        rounds.sync()

    def leave(self) -> None:
        pass  # nothing runs between steps

    # --- one round ----------------------------------------------------------------------------

    def receiving_state(self, q: Assignment) -> None:
        pass  # the training thread is the one waiting for the round

    def contribution(self, q: Assignment, weighted: bool) -> tuple[list[torch.Tensor], float]:
        local = self._s.local
        weight = self._weight() if weighted else 0.0
        with torch.no_grad():
            for acc, (name, p) in zip(self._acc, local.params.items(), strict=True):
                torch.sub(local.snapshot[name], p.detach().to(acc.device), out=acc)
        return self._acc, weight

    def weight_now(self, weighted: bool) -> float:
        return self._weight() if weighted else 0.0

    def left_out(self, q: Assignment) -> None:
        """The model takes the state (``step`` already adopted it when one was taken)."""
        s = self._s
        s.local.adopt_all()
        s.drop_steps(
            s.local_step,
            "worker %s: its contribution to quorum %s was left out; the model takes the run's "
            "state and drops its %d local steps",
            q.quorum_id,
            s.local_step,
        )
        s.local_step, s.samples = 0, 0.0

    def step(self, q: Assignment) -> None:
        """The outer step on the shared state with the quorum's average; the model adopts it."""
        apply_outer_step(self._outer, self._state.globals, self._acc)
        self._s.local.adopt_all()

    def round_ended(self, *, has_state: bool) -> None:
        pass

    def completed(self) -> None:
        """This worker's contribution is in the state: its counters start again."""
        self._s.local_step = 0
        self._s.samples = 0.0

    def settle_counted(self, q: Assignment, steps_then: int) -> None:
        """The model takes the state (its progress was counted); steps since are dropped."""
        s = self._s
        s.local.adopt_all()
        s.local_step, s.samples = 0, 0.0  # nothing left to contribute: weight 0 next
        dropped = s.total_steps - steps_then
        log.warning(
            "worker %s: its contribution to the quorum whose commit point failed here is in "
            "the run's state; the model takes that state%s",
            s.worker_id,
            f" ({dropped} local steps since are dropped)" if dropped else "",
        )
        s.metrics["dropped_steps"] += dropped

    def take_state(self) -> None:
        """The model takes the state received; its local steps are dropped (counted)."""
        s = self._s
        s.local.adopt_all()
        s.drop_steps(
            s.local_step,
            "worker %s: rejoined with the run's state (%d local steps dropped)",
            s.local_step,
        )
        s.local_step, s.samples = 0, 0.0

    def checkpoint_state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The server mode's layout of the whole model: one unit."""
        state = self._outer.state_dict()
        return state, {
            "fragments": [1, SEQUENTIAL],
            "unit_rounds": [self._s.base_round],
            "optimizer_units": [[len(self._state.globals), len(state["param_groups"])]],
        }

    def _weight(self) -> float:
        s = self._s
        if s.local_step == 0 or (s.reports_samples and s.samples == 0):
            # Nothing trained since the last round (a swarm replica's idle steps): its
            # pseudo-gradient is zero and must neither dilute the average nor, as a zero
            # norm, set the median the others' norms are judged by.
            return 0.0
        if self._state.rules.by_samples:
            return s.samples if s.samples > 0 else float(s.local_step)
        return 1.0
