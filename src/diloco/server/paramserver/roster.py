"""The parameter server's side of membership (``members/membership.py``'s ``Roster``): the
fragmenting a registration asks for, the units' aggregators told who joined and left and how
many workers to expect, what a registration reply says of the parameters, and a resumed run's
round opened once the workers that will come back have come back.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

from diloco.server.config import ServerConfig
from diloco.server.members.param_table import differences, mismatch
from diloco.server.members.registry import WorkerRegistry
from diloco.server.rounds.synced_model import Model
from diloco.wire.messages import LastSubmission, Registered, RegisterInfo, Table

log = logging.getLogger(__name__)


class UnitRoster:
    """Membership as the units see it (``Roster``)."""

    def __init__(
        self,
        config: ServerConfig,
        model: Model,
        registry: WorkerRegistry,
        clock: Callable[[], float],
        plan_units: Callable[[], None],
        changed: Callable[[], None],
    ) -> None:
        self.config = config
        self.model = model
        self.registry = registry
        self.clock = clock
        self._plan_units = plan_units  # plans the units once parameters and fragmenting are known
        self._changed = changed
        #: When a run that had closed rounds was resumed, until its round opens (``checked``).
        self.resumed_at: float | None = None

    def shown_round(self) -> int:
        return self.model.shown_round()

    def expected(self) -> int:
        """The first unit's barrier's count, else the configured (or an operator's)."""
        counts = [u.aggregator.public().num_workers for u in self.model.units]
        known = [n for n in counts if n is not None]
        return known[0] if known else self.model.num_workers

    def admit(self, info: RegisterInfo) -> Callable[[str], None]:
        self._check_table(info.params)
        asked = self.model.asked_fragmenting(info)

        def counts(worker_id: str) -> None:
            model = self.model
            if model.fragmenting is None:
                model.fragmenting = asked
                log.info("fragmenting %s set by worker %s", asked, worker_id)
            if model.store is not None and not model.units:
                self._plan_units()
            for unit in model.units:
                unit.aggregator.on_join(self.registry.ids())

        return counts

    def _check_table(self, table: Table | None) -> None:
        """409 ``params_mismatch`` for a worker whose model is not the run's, before anything
        changes: admitted, it would be counted among the expected workers and in the next
        round's barrier until it noticed and left. The run's table is the parameters' once
        the server holds them; before, the table of a live worker that sent one (the first of
        them will seed the parameters). A worker that sends no table is checked by itself."""
        if table is None:
            return
        store = self.model.store
        if store is not None:
            run: Table | None = tuple((s.name, s.shape) for s in store.specs)
        else:
            run = next((w.info.params for w in self.registry if w.info.params), None)
        if run is None or dict(run) == dict(table):
            return
        raise mismatch(
            differences(run, table, ordered=False),
            "Every worker must train the model whose parameters the server holds",
        )

    def told(self, reply: Registered, last_submission: str | None) -> Registered:
        model = self.model
        store = model.store
        fragments, fragment_rounds = model.plan()
        return replace(
            reply,
            mode=self.config.mode,
            instance=store.instance if store else None,
            has_params=store is not None,
            fragments=fragments,
            fragment_rounds=fragment_rounds,
            last_submission=None if last_submission is None else self._last(last_submission),
            params=tuple((s.name, s.shape) for s in store.specs) if store else None,
        )

    def _last(self, submission_id: str) -> LastSubmission:
        """A worker that lost its connection asks whether its last upload was counted in an
        update whose result is in our parameters; if not it keeps that progress (rebases)."""
        counted, in_params = None, False
        for unit in self.model.units:
            history = unit.aggregator.history
            if submission_id in history:
                counted = history[submission_id]
                in_params = counted < unit.published_round
        return LastSubmission(counted_in=counted, in_params=in_params)

    def left(self, worker_id: str) -> None:
        for unit in self.model.units:
            unit.aggregator.on_leave(worker_id)

    def expect(self, num_workers: int) -> None:
        live = self.registry.ids()
        for unit in self.model.units:
            unit.aggregator.set_num_workers(num_workers, live)
        self.model.num_workers = num_workers  # units planned later start from it

    def checked(self) -> None:
        """A resumed run's round waits for ``num_workers`` registrations, as round 0 does, but
        only for ``heartbeat_timeout``: a worker that has not re-registered by then is as gone
        as one that fell silent (it finished its loop, or died while the server was down), and
        waiting for it would hold the workers that did come back until their barrier wait ends.
        The round then opens with the workers here, if they are at least ``min_workers``."""
        resumed, grace = self.resumed_at, self.config.heartbeat_timeout
        if resumed is None or grace <= 0 or self.clock() - resumed < grace:
            return
        live = self.registry.ids()
        tried = [(u.aggregator, u.aggregator.open_with(live)) for u in self.model.units]
        waiting = [a for a, opened in tried if opened is not None]
        opened = [a for a, done in tried if done]
        if opened:
            first = opened[0].public()
            log.warning(
                "round %d opened with %d of %d workers: the others did not re-register within "
                "%g s (heartbeat_timeout) of the restart",
                first.round,
                len(live),
                first.num_workers,
                grace,
            )
            self._changed()
        if len(opened) == len(waiting):
            self.resumed_at = None
