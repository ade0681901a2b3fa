"""Membership and health: registering, leaving, heartbeats, DyLU's recommendation, an operator's
kicks and expected count, and evicting silent, stuck and never-joined workers.

Owns the registry's lifecycle. What a registration means to the mode (the parameter server's
units, all-reduce mode's quorums) is the mode's ``Roster``: it checks a registration before
anything changes, learns who joined and left, and says what the reply tells the worker. Calls
``changed`` after anything that may let a round close, so nothing here imports a front.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable
from typing import Protocol

from diloco.core.dylu import recommended_sync_every, smooth_speed
from diloco.server.config import ServerConfig
from diloco.server.errors import bad_request, unknown_worker
from diloco.server.members.codec_choice import registered_codec
from diloco.server.members.registry import WorkerInfo, WorkerRegistry
from diloco.wire.messages import (
    Deregistered,
    Heartbeat,
    HeartbeatReply,
    Kicked,
    NumWorkersUpdated,
    Register,
    Registered,
    RegisterInfo,
)

log = logging.getLogger(__name__)


class Roster(Protocol):
    """The mode's side of membership."""

    def shown_round(self) -> int:
        """The round to name in replies and log lines."""
        ...

    def expected(self) -> int:
        """Workers the run expects now (registration replies)."""
        ...

    def admit(self, info: RegisterInfo) -> Callable[[str], None]:
        """Check what the mode needs of a registration's ``info`` (400, 409, 422) before
        anything changes; return what makes it count, called with the worker's id once the
        registry holds it."""
        ...

    def told(self, reply: Registered, last_submission: str | None) -> Registered:
        """``reply`` (membership's fields set, the mode's at placeholders) with the mode's
        fields (``mode``, ``instance``, what it holds...), and with ``last_submission`` (the id
        of the worker's last upload, asked about after a lost connection) where that upload was
        counted."""
        ...

    def left(self, worker_id: str) -> None:
        """A worker deregistered, was evicted or kicked."""
        ...

    def expect(self, num_workers: int) -> None:
        """An operator changed how many workers the run expects (validated)."""
        ...

    def checked(self) -> None:
        """A health check has run (a resumed run's round may open now)."""
        ...


class Membership:
    def __init__(
        self,
        config: ServerConfig,
        registry: WorkerRegistry,
        clock: Callable[[], float],
        roster: Roster,
        changed: Callable[[], None],
    ) -> None:
        self.config = config
        self.registry = registry
        self.clock = clock
        self.roster = roster
        self._changed = changed

    def register(self, asked: Register, hostname: str) -> Registered:
        """``POST /register`` from ``hostname`` (the body's, or the address it came from)."""
        info = asked.info
        counts = self.roster.admit(info)
        codec = registered_codec(info.codec, self.config.allowed_codecs)
        # Validated: from here on the registration changes state.
        worker_id = asked.worker_id or f"w-{uuid.uuid4().hex[:10]}"
        record, new = self.registry.add(worker_id, hostname, info)
        record.codec = codec
        counts(worker_id)
        log.info(
            "worker %s %s from %s (round %d)",
            worker_id,
            "registered" if new else "re-registered",
            hostname,
            self.roster.shown_round(),
        )
        self._changed()
        reply = Registered(
            worker_id=worker_id,
            round=self.roster.shown_round(),
            mode=self.config.mode,
            has_params=False,
            num_workers=self.roster.expected(),
            poll_timeout=self.config.poll_timeout,
            codecs=self.config.allowed_codecs,
            outer_rule=self.config.outer_rule,
            recommended_sync_every=self._recommend(record),
            weighting=self.config.weighting,
        )
        return self.roster.told(reply, asked.last_submission_id)

    def deregister(self, worker_id: str, *, died: bool = False) -> Deregistered:
        if self.registry.remove(worker_id, died=died) is None:
            raise unknown_worker(worker_id)
        self.roster.left(worker_id)
        log.info(
            "worker %s %s (round %d)",
            worker_id,
            "evicted" if died else "left",
            self.roster.shown_round(),
        )
        self._changed()
        return Deregistered(round=self.roster.shown_round())

    def kick(self, worker_id: str) -> Kicked:
        """Evict a worker on request. Its accepted submission stays counted; a kicked worker
        that is still running gets 410 at its next request and may re-join."""
        if worker_id not in self.registry:
            raise unknown_worker(worker_id)
        log.warning(
            "worker %s kicked by an operator (round %d)", worker_id, self.roster.shown_round()
        )
        self.registry.kicks += 1
        self.deregister(worker_id, died=False)
        return Kicked(round=self.roster.shown_round(), kicked=worker_id)

    def set_num_workers(self, num_workers: int) -> NumWorkersUpdated:
        """Change how many workers the run expects (round 0 or the first quorum waits for
        them; never below ``min_workers``)."""
        if num_workers < self.config.min_workers:
            raise bad_request(
                "bad_field",
                f"num_workers must be >= min_workers ({self.config.min_workers}), "
                f"got {num_workers}",
            )
        self.roster.expect(num_workers)
        log.info("expected workers set to %d (round %d)", num_workers, self.roster.shown_round())
        self._changed()
        return NumWorkersUpdated(num_workers=num_workers)

    def heartbeat(self, beat: Heartbeat) -> HeartbeatReply:
        """``POST /heartbeat`` (its values checked by the message before anything changes);
        absent values keep the last reported."""
        record = self.registry.touch(beat.worker_id)
        if record is None:
            raise unknown_worker(beat.worker_id)
        if beat.syncing is not None:
            record.syncing = beat.syncing
        self.registry.reported_speed(record, beat.steps_per_second)
        if beat.loss is not None:
            record.loss = beat.loss
        if beat.step_age_s is not None:
            record.step_age_s = beat.step_age_s
        # A worker that spent the interval syncing reports no speed (or 0): the smoothed speed
        # keeps its previous value instead of collapsing, so DyLU does not flap.
        record.smoothed_speed = smooth_speed(record.smoothed_speed, beat.steps_per_second)
        return HeartbeatReply(
            round=self.roster.shown_round(), recommended_sync_every=self._recommend(record)
        )

    def _recommend(self, record: WorkerInfo) -> int | None:
        """DyLU: this worker's sync_every from its smoothed speed relative to the fastest."""
        if not self.config.dylu:
            return None
        base = self.config.dylu_base_sync_every or record.info.sync_every
        if base is None:
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
                "evicting worker %s: %s (round %d)", worker_id, why, self.roster.shown_round()
            )
            self.deregister(worker_id, died=True)
            evicted.append(worker_id)
        self.roster.checked()
        return evicted

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
