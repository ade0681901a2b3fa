"""What the all-reduce mode's quorum loop (``QuorumSync``) leaves to its payload: what one round
averages and steps, and when a round is due. Two payloads: the whole model every ``sync_every``
steps (``WholeModel``), or one fragment per round, overlapped with training (``FragmentRounds``).

The loop owns everything else of a round and calls the payload at fixed points:

    after_step / sync_now (the schedule)  ->  rounds.sync() or rounds.attempts()
      ask for a quorum (telling weight_now(weighted)), build its collective
      receiving_state(q)                  (only when this worker must receive the state)
      broadcast of the state, hash checked, then rebase, settle_counted(q, steps) or
        take_state() (a worker rejoining after too many exclusions)
      contribution(q, weighted)           -> tensors and weight; checked average, commit point
      step(q)                             (only when the admitted weights summed to more than 0)
      left_out(q)                         (only when the checks left this worker's part out)
      hash reported, save
      round_ended(has_state)              (always, even after a failure)
    completed()                           (a round completed with this worker's contribution)

The schedule may run rounds on a thread of its own (``FragmentRounds``): then the round's
members above run on that thread while the training thread steps, and the payload keeps the
model safe from both (``Park``).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from diloco.wire.messages import Assignment


class Rounds(Protocol):
    """What a payload's schedule asks of the quorum loop."""

    def sync(self) -> None:
        """Quorum rounds until one completes with this worker's contribution, or the loop gives
        up (too many discarded, ``max_barrier_wait`` passed, the server unreachable, the worker
        leaving), on the training thread, counted as syncing and as sync time. Never raises a
        network error."""
        ...

    def attempts(self) -> bool:
        """The same rounds for a thread of the payload's own (no training-thread bookkeeping):
        True if one completed with this worker's contribution. Never raises a network error."""
        ...


class Payload(Protocol):
    """What a quorum round averages and steps, and when a round is due."""

    # --- the schedule (training thread) ---------------------------------------------------------

    def after_step(self, rounds: Rounds) -> None:
        """One inner step was taken (``session.total_steps`` counted it): run a round through
        ``rounds`` when one is due, and settle one that ended; keep ``session.local_step`` at
        the steps counted toward the next round. A re-registration the heartbeats asked for
        (``session.need_rejoin``) happens at the start of the next round (``WholeModel`` runs
        one at once for it). Never raises a network error."""
        ...

    def sync_now(self, rounds: Rounds) -> None:
        """A round now, blocking, whatever the step count (``force_sync``), after the one in
        flight if any. Never raises a network error."""
        ...

    def leave(self) -> None:
        """The worker is leaving (the loop's rounds give up from now on): end the round in
        flight, if any, and settle it."""
        ...

    # --- one round (the thread that runs the rounds) --------------------------------------------

    def receiving_state(self, q: Assignment) -> None:
        """This worker is about to receive the quorum's state into the snapshot, then rebase
        the model on it: make the model safe to write (the training thread stopped between
        steps) until ``round_ended`` says the state is here. Raises ``QuorumFailed`` if it
        cannot within ``q.timeout``."""
        ...

    def contribution(self, q: Assignment, weighted: bool) -> tuple[list[torch.Tensor], float]:
        """The pseudo-gradient of this round's share of the model (``snapshot - local``), in
        buffers of the payload's own that the quorum averages in place, and this worker's
        weight in the average (0 unless ``weighted``; 0 too when nothing was trained since
        the share's last contribution). Raises ``QuorumFailed`` if the model cannot be read
        within ``q.timeout``."""
        ...

    def weight_now(self, weighted: bool) -> float:
        """The weight this worker would contribute if a round started now (0 unless
        ``weighted``), told in its quorum ask; cheap (counters only)."""
        ...

    def left_out(self, q: Assignment) -> None:
        """The quorum's checks left this worker's contribution to round ``q`` out (a non-finite
        pseudo-gradient, a norm far above the quorum's, a weight out of bounds): after the
        round's step, if any, the model takes the agreed state (the whole model: its own
        progress is not to be trusted), and the steps that progress spanned are counted in
        ``dropped_steps``. A payload whose rounds run beside training does this on the training
        thread, when it merges the round."""
        ...

    def step(self, q: Assignment) -> None:
        """The buffers hold the quorum's average: the outer step on the round's share of the
        state (the snapshot and the momentum, in place). ``WholeModel``'s model adopts the new
        parameters here; ``FragmentRounds`` merges later (``completed`` or its schedule)."""
        ...

    def round_ended(self, *, has_state: bool) -> None:
        """A round ended, completed or failed. ``has_state`` False: the state this worker
        began to receive broke off, and the model must stay safe to write until a later
        round delivers it."""
        ...

    def completed(self) -> None:
        """A round completed with this worker's contribution: its counters start again
        (``WholeModel``), or the fragment is marked sent and merged (``FragmentRounds``, when
        the round ran on the training thread)."""
        ...

    def settle_counted(self, q: Assignment, steps_then: int) -> None:
        """The state just received was made by a quorum whose commit point failed here after
        this worker's contribution was in its average (``steps_then``: ``total_steps`` then):
        that progress is in the state and must not count again. The model takes the state for
        the share that was counted; any steps dropped with it are counted and logged."""
        ...

    def take_state(self) -> None:
        """The worker rejoins after the checks excluded it too often (409 ``left_out``, action
        ``rejoin``) and has just received the run's state: its whole model takes that state, the
        progress it drops is counted once in ``dropped_steps`` (the steps since the oldest
        contribution still uncounted: none counted before by a left-out merge, none again
        later), and every counter of what it trained starts again, so that no later round
        weighs progress it no longer holds. The model is safe to write (``receiving_state``)."""
        ...

    def checkpoint_state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The outer optimizers' state dict, and the checkpoint fields that say how it is cut
        (``fragments``, ``unit_rounds``, ``optimizer_units``: the server mode's layout)."""
        ...
