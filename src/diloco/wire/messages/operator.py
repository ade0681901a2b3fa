"""An operator steering a running server: the bodies of ``POST /control/*`` and their replies.
Every body is a JSON object read strictly, so a typo never passes for a no-op; the values are
checked by the server (``lr`` positive, ``num_workers`` at least ``min_workers``...).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Self

from diloco.wire.messages.codec import MessageError, Reply, Request, spec, text


@dataclass(frozen=True)
class SaveState(Request):
    """``POST /control/save_state``: write a checkpoint now (an empty object)."""


@dataclass(frozen=True, kw_only=True)
class Saved(Reply):
    """The reply to ``SaveState`` in server mode: the checkpoint is written."""

    status: str = "ok"
    """Always ``ok``."""
    path: str
    """The checkpoint's folder."""
    round: int
    """The round it holds."""


@dataclass(frozen=True, kw_only=True)
class SaveRequested(Reply):
    """202, the reply to ``SaveState`` in all-reduce mode: rank 0 of the next quorum saves
    after its round (the workers hold the state)."""

    status: str = "requested"
    """Always ``requested``."""
    round: int
    """The run's round now."""


@dataclass(frozen=True)
class KickWorker(Request):
    """``POST /control/kick_worker``: evict a worker (its accepted upload stays counted; a
    kicked worker still running gets 410 and may join again)."""

    worker_id: str = spec(rule=text())
    """The worker to evict."""


@dataclass(frozen=True, kw_only=True)
class Kicked(Reply):
    """The reply to ``KickWorker``."""

    status: str = "ok"
    """Always ``ok``."""
    round: int
    """The run's round."""
    kicked: str
    """The evicted worker."""


@dataclass(frozen=True)
class UpdateOptimizer(Request):
    """``POST /control/update_optimizer``: change the outer optimizer's hyperparameters (at
    least one of them)."""

    lr: float | None = spec(default=None, omit=True)
    """The new outer learning rate."""
    momentum: float | None = spec(default=None, omit=True)
    """The new outer momentum."""

    def checked(self) -> Self:
        if self.lr is None and self.momentum is None:
            raise MessageError("lr", "give 'lr', 'momentum' or both")
        return self


@dataclass(frozen=True)
class OuterHparams(Reply):
    """The outer optimizer's hyperparameters."""

    lr: float
    """Outer learning rate."""
    momentum: float | None = spec(default=None, omit=True)
    """Outer momentum (absent for an optimizer without one)."""


@dataclass(frozen=True, kw_only=True)
class OptimizerUpdated(Reply):
    """The reply to ``UpdateOptimizer``."""

    status: str = "ok"
    """Always ``ok``."""
    outer_optimizer: OuterHparams
    """The hyperparameters now."""


@dataclass(frozen=True)
class UpdateNumWorkers(Request):
    """``POST /control/update_num_workers``: the workers the run expects (round 0, and a fresh
    all-reduce run's first quorum, wait for them)."""

    num_workers: int = spec()
    """The new count (at least the server's ``min_workers``)."""


@dataclass(frozen=True, kw_only=True)
class NumWorkersUpdated(Reply):
    """The reply to ``UpdateNumWorkers``."""

    status: str = "ok"
    """Always ``ok``."""
    num_workers: int
    """The count now."""


@dataclass(frozen=True)
class Shutdown(Request):
    """``POST /control/shutdown``: stop the server after the reply."""

    save: bool = True
    """Write a checkpoint first (with ``--save-dir``)."""


@dataclass(frozen=True, kw_only=True)
class ShuttingDown(Reply):
    """The reply to ``Shutdown``, sent before the server stops."""

    status: str = "shutting_down"
    """Always ``shutting_down``."""
    save: bool
    """Whether it saves first."""
    round: int
    """The run's round."""
