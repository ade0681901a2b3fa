"""The run's state in all-reduce mode, which the workers hold (the server holds none): the
global parameters (``LocalModel``'s snapshot, made from this worker's own parameters at start)
and the outer optimizer's momentum, both fp32; the hash a quorum compares them by; and rank 0's
checkpoint of them in the server mode's layout (``diloco.persistence``: parameters, the outer
optimizer's state, the fields a server checks when it resumes), so ``diloco server --save-dir``
can go on from it and a run moves between the modes.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from diloco.core.outer import OuterSGD
from diloco.persistence import save_checkpoint
from diloco.persistence.lazy_tensors import LazyTensors
from diloco.wire.messages import Registered
from diloco.worker.allreduce.average_checks import Averaged
from diloco.worker.allreduce.collective import QuorumCollective, broadcast, state_hash
from diloco.worker.allreduce.shard_exchange import WHOLE_MODEL, same_layout
from diloco.worker.session import Session
from diloco.worker.state.start_state import StartState

log = logging.getLogger(__name__)

KEEP_CHECKPOINTS = 3
"""Checkpoints rank 0 keeps in its own ``save_dir`` (as many as a server keeps by default)."""


@dataclass(frozen=True)
class RunRules:
    """What the server's registration reply says about the run's outer step and weighting."""

    lr: float
    momentum: float
    nesterov: bool
    by_samples: bool  # a member's weight in an average is its samples (else: 1 per member)
    # A member whose norm is above this many times the quorum's median is left out of a round
    # (``Registered.norm_bound``); a server that does not say (an older one) judges no norms.
    norm_bound: float = math.inf
    # Swarm mode: the pipeline stage whose replicas sync (``Registered.stage``); rank 0 saves
    # under ``save_dir/stage-<stage>``, one folder per stage. None: the whole model.
    stage: int | None = None

    @classmethod
    def of(cls, reply: Registered) -> RunRules:
        """The server decides them (``diloco server --outer-lr ...``); a reply without them
        comes from a server this worker cannot follow."""
        outer, weighting = reply.outer, reply.weighting
        if outer is None or weighting is None:
            raise ValueError(
                "the server's all-reduce registration reply lacks the outer step or the "
                "weighting (a server of another version?)"
            )
        return cls(
            lr=outer.lr,
            momentum=outer.momentum,
            nesterov=outer.nesterov and outer.momentum > 0,
            by_samples=weighting == "samples",
            norm_bound=reply.norm_bound if reply.norm_bound is not None else math.inf,
            stage=reply.stage,
        )


class SharedState:
    """The snapshot (owned from here on) and the momentum buffers beside it, with the rules
    that step them. Momentum buffers exist from the start (zeros: the first step's ``0 * m + g``
    is ``g`` exactly, as torch's first-step copy), so a joiner can receive them by broadcast."""

    #: The state is elsewhere (a sharded group's shards): the quorum loop averages through
    #: ``streamed_average``, not the payload's tensors.
    streamed = False

    def __init__(self, session: Session, rules: RunRules) -> None:
        self._s = session
        self.rules = rules
        local = session.local
        local.own_snapshot()
        #: The snapshot as parameters sharing its memory: an outer optimizer steps it in place.
        self.globals = [torch.nn.Parameter(t, requires_grad=False) for t in local.snapshot.values()]
        #: One buffer per parameter (none without momentum).
        self.momentum: list[torch.Tensor] = (
            [torch.zeros_like(p) for p in self.globals] if rules.momentum > 0 else []
        )

    @property
    def snapshot(self) -> dict[str, torch.Tensor]:
        return self._s.local.snapshot

    def tensors(self) -> list[torch.Tensor]:
        """Everything a member holds of the run, in the order a quorum broadcasts and hashes."""
        return [*self.snapshot.values(), *self.momentum]

    def hash(self) -> str:
        """The fingerprint a quorum compares (``collective.state_hash``)."""
        return state_hash(self.tensors())

    def start_from(self, start: StartState) -> None:
        """Hold ``start``'s snapshot and momentum (``StartState.load``)."""
        start.load(self.snapshot, self.momentum)

    def broadcast(self, quorum: QuorumCollective, src: int) -> None:
        """Rank ``src``'s state into every member's (a joiner's resync)."""
        broadcast(quorum, self.tensors(), src)

    def meet(self, quorum: QuorumCollective, worker_id: str, path: str) -> None:
        """A quorum's first step on every member: the members compare their layouts (one tiny
        collective, ``shard_exchange.same_layout``); a plain member's is the whole model, so it
        learns nothing here. Sharded groups that all share one layout then average shard with
        shard (``StreamedState``). ``path``: the quorum's rendezvous (``Rendezvous.path``)."""
        same_layout(quorum, WHOLE_MODEL)

    def part(self) -> None:
        """The quorum is over (whatever happened): undo what ``meet`` set up."""

    def streamed_average(
        self, quorum: QuorumCollective, weight: float, comm: torch.dtype, sample: int
    ) -> tuple[Averaged, list[torch.Tensor], int]:
        """Only where ``streamed``: the quorum's checked average of a contribution that is not
        in this process (``sharded_whole.StreamedState``), every ``sample``-th element of each
        tensor (the commit point's sample), and the elements averaged."""
        raise AssertionError("a SharedState's contribution is the payload's tensors")

    def outer(
        self, params: Sequence[torch.nn.Parameter], buffers: Sequence[torch.Tensor]
    ) -> OuterSGD:
        """An outer optimizer over ``params`` (views of the snapshot) by the run's rules, whose
        momentum is ``buffers`` (views of ``momentum``, one per parameter; empty without)."""
        rules = self.rules
        outer = OuterSGD(params, lr=rules.lr, momentum=rules.momentum, nesterov=rules.nesterov)
        if buffers:
            for p, buf in zip(params, buffers, strict=True):
                outer.state[p]["momentum_buffer"] = buf
        return outer

    def save(
        self,
        quorum_id: str,
        state: dict[str, Any],
        layout: dict[str, Any],
        *,
        params: LazyTensors | None = None,
        momentum: LazyTensors | None = None,
    ) -> None:
        """Rank 0: write the snapshot and ``state`` (the outer optimizer's state dict) at the
        session's ``base_round`` into the worker's ``save_dir`` (its stage's folder in swarm
        mode, ``RunRules.stage``); ``layout holds the fields that
        say how the state is cut (``fragments``, ``unit_rounds``, ``optimizer_units``). Blocking;
        a failure (or no ``save_dir``) is logged, never raised into training. ``params`` and
        ``momentum``: the state read one tensor at a time instead (a sharded group's)."""
        s = self._s
        folder = s.settings.save_dir
        if folder is None:
            log.warning(
                "worker %s: the server asked rank 0 to save round %d, but this worker has no "
                "save_dir (DILOCO_SAVE_DIR, diloco worker --save-dir)",
                s.worker_id,
                s.base_round,
            )
            return
        if self.rules.stage is not None:
            folder = os.path.join(folder, f"stage-{self.rules.stage}")
        tensors: dict[str, torch.Tensor] | LazyTensors = (
            dict(s.local.snapshot) if params is None else params
        )
        extra = {
            "param_order": list(tensors),
            "mode": "sync",
            **layout,
            "outer_optimizer": OuterSGD.__name__,
            "receipts": [],
            "worker_deaths": 0,
            "instance": quorum_id,
            "written_by": f"all-reduce rank 0 ({s.worker_id})",
        }
        try:
            path = save_checkpoint(
                folder,
                s.base_round,
                tensors,
                state,
                extra,
                KEEP_CHECKPOINTS,
                optimizer_tensors=momentum,
            )
        except OSError as exc:
            log.error(
                "worker %s: checkpoint of round %d failed: %s", s.worker_id, s.base_round, exc
            )
            return
        log.info("worker %s saved round %d to %s", s.worker_id, s.base_round, path)
