"""Membership and health: registering, leaving, heartbeats, DyLU's recommendation, evicting
silent, stuck and never-joined workers, and opening a resumed run's round when the workers that
will come back have come back.

Owns the registry's lifecycle and the resume deadline. Tells each unit's aggregator who joined
or left, and calls ``changed`` after anything that may let a round close (the coordinator then
closes what is ready), so nothing here imports the coordinator.
"""

from __future__ import annotations

import asyncio
import logging
import math
import uuid
from collections.abc import Callable
from typing import Any

from diloco.core.dylu import recommended_sync_every, smooth_speed
from diloco.server.config import ServerConfig
from diloco.server.errors import bad_request, unknown_worker
from diloco.server.model import Model
from diloco.server.registry import WorkerInfo, WorkerRegistry
from diloco.server.upload_body import registered_codec

log = logging.getLogger(__name__)


class Membership:
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
        #: Told of every worker that leaves (all-reduce mode: server/allreduce.py sets it).
        self.left: Callable[[str], None] | None = None
        #: When a run that had closed rounds was resumed, until its round opens (see
        #: _open_resumed_rounds).
        self.resumed_at: float | None = None

    def num_workers(self) -> int:
        """Workers the run expects: the first unit's barrier's count, else the configured."""
        counts = [u.aggregator.public().num_workers for u in self.model.units]
        known = [n for n in counts if n is not None]
        return known[0] if known else self.model.num_workers

    def register(
        self, worker_id: str | None, hostname: str, info: dict[str, Any]
    ) -> dict[str, Any]:
        model = self.model
        asked = model.asked_fragmenting(info)
        codec = registered_codec(info, self.config.allowed_codecs)
        # Validated: from here on the registration changes state.
        worker_id = worker_id or f"w-{uuid.uuid4().hex[:10]}"
        record, new = self.registry.add(worker_id, hostname, info)
        record.codec = codec
        if model.fragmenting is None:
            model.fragmenting = asked
            log.info("fragmenting %s set by worker %s", asked, worker_id)
        if model.store is not None and not model.units:
            self._plan_units()
        for unit in model.units:
            unit.aggregator.on_join(self.registry.ids())
        log.info(
            "worker %s %s from %s (round %d)",
            worker_id,
            "registered" if new else "re-registered",
            hostname,
            model.shown_round(),
        )
        self._changed()
        store = model.store
        reply: dict[str, Any] = {
            "worker_id": worker_id,
            "round": model.shown_round(),
            "mode": self.config.mode,
            "instance": store.instance if store else None,
            "has_params": store is not None,
            "num_workers": self.num_workers(),
            "poll_timeout": self.config.poll_timeout,
            "codecs": list(self.config.allowed_codecs),
            **model.plan(),
        }
        recommended = self._recommend(record)
        if recommended is not None:
            reply["recommended_sync_every"] = recommended
        last = info.get("last_submission_id")
        if isinstance(last, str) and last:
            # A worker that lost its connection asks whether its last upload was counted in an
            # update whose result is in our parameters; if not it keeps that progress (rebases).
            counted, in_params = None, False
            for unit in model.units:
                history = unit.aggregator.history
                if last in history:
                    counted = history[last]
                    in_params = counted < unit.published_round
            reply["last_submission"] = {"counted_in": counted, "in_params": in_params}
        if store is not None:
            reply["params"] = [[s.name, list(s.shape)] for s in store.specs]
        return reply

    def deregister(self, worker_id: str, *, died: bool = False) -> dict[str, Any]:
        if self.registry.remove(worker_id, died=died) is None:
            raise unknown_worker(worker_id)
        for unit in self.model.units:
            unit.aggregator.on_leave(worker_id)
        if self.left is not None:
            self.left(worker_id)
        log.info(
            "worker %s %s (round %d)",
            worker_id,
            "evicted" if died else "left",
            self.model.shown_round(),
        )
        self._changed()
        return {"status": "ok", "round": self.model.shown_round()}

    def heartbeat(self, worker_id: str, body: dict[str, Any]) -> dict[str, Any]:
        if worker_id not in self.registry:
            raise unknown_worker(worker_id)
        updates: dict[str, Any] = {}
        if "syncing" in body:
            if not isinstance(body["syncing"], bool):
                raise bad_request("bad_field", "syncing must be a boolean")
            updates["syncing"] = body["syncing"]
        for key in ("steps_per_second", "loss", "step_age_s"):
            value = body.get(key)
            if value is not None:
                if (
                    isinstance(value, bool)
                    or not isinstance(value, (int, float))
                    or not math.isfinite(value)
                ):
                    raise bad_request("bad_field", f"{key} must be a finite number")
                updates[key] = float(value)
        record = self.registry.touch(worker_id)  # validated first: a bad request changes nothing
        assert record is not None
        for key, value in updates.items():
            setattr(record, key, value)
        # A worker that spent the interval syncing reports no speed (or 0): the smoothed speed
        # keeps its previous value instead of collapsing, so DyLU does not flap.
        record.smoothed_speed = smooth_speed(record.smoothed_speed, updates.get("steps_per_second"))
        reply: dict[str, Any] = {"status": "ok", "round": self.model.shown_round()}
        recommended = self._recommend(record)
        if recommended is not None:
            reply["recommended_sync_every"] = recommended
        return reply

    def _recommend(self, record: WorkerInfo) -> int | None:
        """DyLU: this worker's sync_every from its smoothed speed relative to the fastest."""
        if not self.config.dylu:
            return None
        base = record.info.get("sync_every")
        if isinstance(base, bool) or not isinstance(base, int) or base < 1:
            return None
        speeds = {w.worker_id: w.smoothed_speed for w in self.registry}
        value = recommended_sync_every(speeds, base, self.config.dylu_min_sync_every)
        record.recommended_sync_every = value[record.worker_id]
        return record.recommended_sync_every

    def check_health(self) -> list[str]:
        """Evict silent and stuck workers, and ghosts (registered, never joined); returns their
        ids. Called periodically, and directly by tests with a fake clock."""
        evicted = []
        reasons = {}
        if self.config.join_timeout > 0:
            reasons.update(
                {
                    w: f"no download, heartbeat or upload within {self.config.join_timeout:g} s "
                    "of registering (join_timeout): it failed while joining"
                    for w in self.registry.unjoined(self.config.join_timeout)
                }
            )
        if self.config.heartbeat_timeout > 0:
            reasons.update(
                {w: "silent" for w in self.registry.silent(self.config.heartbeat_timeout)}
            )
        if self.config.stuck_timeout > 0:
            reasons.update({w: "stuck" for w in self.registry.stuck(self.config.stuck_timeout)})
        for worker_id, why in reasons.items():
            log.warning(
                "evicting worker %s: %s (round %d)", worker_id, why, self.model.shown_round()
            )
            self.deregister(worker_id, died=True)
            evicted.append(worker_id)
        self._open_resumed_rounds()
        return evicted

    def _open_resumed_rounds(self) -> None:
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

    async def health_loop(self) -> None:
        config = self.config
        deadlines = (config.heartbeat_timeout, config.stuck_timeout, config.join_timeout)
        timeouts = [t for t in deadlines if t > 0]
        if not timeouts:
            return
        # A dead worker is evicted at most this late: every surviving worker of a sync barrier
        # or an all-reduce quorum waits for it, so at most half a second, whatever the timeout
        # (a scan of the registry costs microseconds).
        interval = max(0.05, min(min(timeouts) / 4, 0.5))
        while True:
            await asyncio.sleep(interval)
            self.check_health()
