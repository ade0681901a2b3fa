"""A worker that starts from a checkpoint's state (all-reduce and swarm mode), not from its own
parameters at round 0: a swarm peer moved to a stage whose quorums agreed rounds restores the
stage's newest checkpoint (``swarm/peer_life.py``).

A quorum takes a member as a source only when the (round, hash) it presents is one the run
agreed on (``server/allreduce/agreement.py``), and the hash covers the snapshot AND the outer
momentum (``SharedState.hash``). Rank 0's checkpoint holds both as they were when its quorum's
step made round ``r`` (``SharedState.save``: the snapshot, the outer optimizer's state with one
``momentum_buffer`` per parameter in ``param_order``). A worker that takes them bit for bit and
says round ``r`` presents exactly what a member that lived through round ``r`` presents, so the
Agreement, which recorded (r, hash) when the round completed, accepts it as a source (or, where
a live member holds a later round, resyncs it like any member that missed rounds).

Only the whole model's layout (one unit, ``OuterSGD``, sync mode) is read: a streaming run's
checkpoint cuts the state by fragments, which a worker does not start from here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from diloco.core.outer import OuterSGD
from diloco.persistence.folders import Checkpoint


@dataclass(frozen=True)
class StartState:
    """The run's state a worker starts from: ``round``, the global parameters (fp32, by wire
    name) and the outer momentum, one buffer per parameter in ``params``' order (None: the
    checkpoint holds none, a run without momentum)."""

    round: int
    params: Mapping[str, torch.Tensor]
    momentum: tuple[torch.Tensor, ...] | None
    origin: str  # where it came from, for the log

    @classmethod
    def of_checkpoint(cls, found: Checkpoint) -> StartState:
        """The state of a checkpoint in the project's layout. ValueError (naming the folder)
        for one that is not the whole model's layout, or whose momentum is partial."""
        extra = found.extra
        fragments = extra.get("fragments", [1])
        if extra.get("mode", "sync") != "sync" or (fragments and fragments[0] != 1):
            raise ValueError(
                f"{found.path}: not a whole-model sync checkpoint (mode {extra.get('mode')!r}, "
                f"fragments {fragments!r}): a worker starts only from one unit's state"
            )
        if extra.get("outer_optimizer", OuterSGD.__name__) != OuterSGD.__name__:
            raise ValueError(
                f"{found.path}: outer optimizer {extra['outer_optimizer']!r}, not "
                f"{OuterSGD.__name__}"
            )
        order = list(extra.get("param_order") or found.params)
        if set(order) != set(found.params):
            raise ValueError(f"{found.path}: param_order does not name its parameters")
        params = {n: found.params[n] for n in order}
        state: dict[Any, Any] = found.optimizer_state.get("state", {})
        buffers = [state.get(i, {}).get("momentum_buffer") for i in range(len(order))]
        if all(b is None for b in buffers):
            return cls(found.round, params, None, str(found.path))
        if any(b is None for b in buffers):
            raise ValueError(f"{found.path}: the outer momentum misses some parameters")
        for n, b in zip(order, buffers, strict=True):
            assert b is not None
            if b.shape != params[n].shape:
                raise ValueError(
                    f"{found.path}: momentum of {n!r} is {tuple(b.shape)}, its "
                    f"parameter {tuple(params[n].shape)}"
                )
        return cls(found.round, params, tuple(buffers), str(found.path))

    def load(self, snapshot: dict[str, torch.Tensor], momentum: list[torch.Tensor]) -> None:
        """Copy the state into a worker's snapshot and momentum buffers (in place: the outer
        optimizer holds views of them). ValueError, before anything is copied, when the names
        or shapes differ from the snapshot's, or when the run has momentum and the state
        carries a different count of buffers. A run with momentum given a state without any
        keeps zeros: its hash is then no agreed state's, and the quorum hands it the run's."""
        if list(snapshot) != list(self.params):
            raise ValueError(
                f"{self.origin}: its parameters are not the model's: "
                f"{sorted(set(snapshot) ^ set(self.params))[:5]} differ"
            )
        for n, t in snapshot.items():
            if t.shape != self.params[n].shape:
                raise ValueError(
                    f"{self.origin}: {n!r} is {tuple(self.params[n].shape)}, the "
                    f"model's {tuple(t.shape)}"
                )
        given = self.momentum if momentum else None
        if given is not None and len(given) != len(momentum):
            raise ValueError(
                f"{self.origin}: {len(given)} momentum buffers, the run has {len(momentum)}"
            )
        with torch.no_grad():
            for n, t in snapshot.items():
                t.copy_(self.params[n])
            for buf, b in zip(momentum, given or (), strict=False):
                buf.copy_(b)
            if given is None:
                for buf in momentum:
                    buf.zero_()
