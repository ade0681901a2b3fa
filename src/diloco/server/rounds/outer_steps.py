"""What an aggregator may use to make an outer update: the tensor lock, publication (with its
checkpoint), the run log, the live workers, and the intake's hold on a sum. One ``OuterSteps``
is shared by every unit's aggregator; it is handed in, so no aggregator imports the coordinator.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from diloco.core.finite import FiniteGuard
from diloco.server.config import ServerConfig
from diloco.server.errors import ApiError, conflict
from diloco.server.observe.run_log import RunLog
from diloco.server.rounds.aggregator import Verdict
from diloco.server.rounds.checkpoints import Checkpoints
from diloco.server.rounds.synced_model import Model
from diloco.server.rounds.units import Unit


@dataclass
class OuterSteps:
    config: ServerConfig
    clock: Callable[[], float]
    #: Orders tensor work: adds to a sum, outer steps, checkpoint writes.
    lock: asyncio.Lock
    model: Model
    checkpoints: Checkpoints
    run_log: RunLog
    #: The registered workers now.
    live: Callable[[], set[str]]
    #: Wait until no first write owns the unit's sum (server/intake/intake.py).
    sum_free: Callable[[Unit], Awaitable[None]]
    #: Close whatever is ready now (the coordinator's): a quorum round's timer calls it.
    wake: Callable[[], None] = lambda: None
    #: Per unit: the guard of its outer steps (core/finite.py), made at its first step.
    _guards: dict[int, FiniteGuard] = field(default_factory=dict)

    def guard(self, unit: Unit) -> FiniteGuard:
        guard = self._guards.get(unit.index)
        if guard is None:
            guard = self._guards[unit.index] = FiniteGuard(unit.optimizer, unit.params)
        return guard

    def where(self, unit: Unit) -> str:
        """`` of fragment N`` in log lines, when the run streams fragments."""
        return f" of fragment {unit.index}" if len(self.model.units) > 1 else ""

    def too_stale(self, unit: Unit, base: int, stale: int) -> ApiError:
        return conflict(
            Verdict.TOO_STALE.value,
            f"{stale} updates were applied since version {base}, more than "
            f"max_staleness={self.config.max_staleness}; rebase onto the current parameters",
            action="rebase",
            round=unit.round,
            staleness=stale,
            fragment=self.model.fragment_of(unit),
        )
