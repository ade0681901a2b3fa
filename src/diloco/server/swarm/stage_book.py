"""Swarm mode's state: which peer hosts which stage, each stage's agreed parameter table, the
ready replicas' addresses, what their heartbeats reported, the suspects, and the route table
built from them with its version and long poll.

Invariants (each tested):
- a replica is in the route table iff it is assigned a stage, said ready with that stage's
  table, is registered (the front calls ``left`` on every leave, eviction and kick) and no
  driver reported it suspect since its last heartbeat;
- a stage's table is fixed by its first ready peer, or its first registration that carries a
  table (a ``DiLoCoWorker`` syncing the stage), whichever comes first, and never changes in this
  server life (a replacement must host the same stage module, even after every replica left);
  ``check_table`` is the one check both paths run;
- every check happens before anything changes: a refused call leaves no trace;
- the version increases exactly when the table's content changes; a long poll returns at once
  on another version, else on the next change or its bound.

Event loop thread only; the clock is injected (tests fake it).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Collection
from dataclasses import dataclass, replace

from diloco.server.errors import ApiError, bad_request, conflict
from diloco.server.members.param_table import differences, mismatch
from diloco.server.observe.swarm_records import (
    BoundaryStatus,
    StageStatus,
    SuspectStatus,
    SwarmStatus,
)
from diloco.server.params.wakeup import Wakeup
from diloco.server.swarm.assignment import choose_move, choose_stage, fitting, stage_throughput
from diloco.wire.messages import Table
from diloco.wire.messages.registration import SwarmBeat
from diloco.wire.messages.swarm import (
    Replica,
    RouteTable,
    StageReady,
    StageRoutes,
    SuspectReport,
)


@dataclass(frozen=True)
class Suspicion:
    reporter: str
    reason: str
    at: float


def wrong_stage(peer: str, asked: int, assigned: int) -> ApiError:
    return conflict(
        "wrong_stage",
        f"peer {peer!r} was assigned stage {assigned} at registration, not {asked}: it must "
        "host the stage it was given (register again to be assigned anew)",
    )


class StageBook:
    """The stages of one server life (in memory: after a restart the peers register again)."""

    def __init__(self, num_stages: int, min_replicas: int, clock: Callable[[], float]) -> None:
        self.num_stages = num_stages
        self.min_replicas = min_replicas
        self.clock = clock
        self.assigned: dict[str, int] = {}
        self.tables: dict[int, Table] = {}
        self.ready: dict[str, str] = {}  # peer -> its stage service's address
        self.suspects: dict[str, Suspicion] = {}
        self.beats: dict[str, SwarmBeat] = {}
        self.fits_of: dict[str, tuple[int, ...] | None] = {}  # what each said fits it
        #: Moves decided and not yet told: peer -> its new stage (its next heartbeat's reply).
        self.moves: dict[str, int] = {}
        self.suspect_reports = 0
        self.version = 0
        self._table = self._build()
        self._wakeup: Wakeup | None = None  # made on the event loop, at the first wait

    # --- registration ---------------------------------------------------------------------------

    def fits(self, fits: Collection[int] | None) -> list[int]:
        """The stages a registering peer may host (400 ``no_fitting_stage`` when none)."""
        try:
            return fitting(self.num_stages, fits)
        except ValueError as exc:
            raise bad_request("no_fitting_stage", str(exc)) from None

    def pick(self, peer: str, fits: Collection[int] | None) -> int:
        """The stage ``assign`` would give the peer now, changing nothing: the one it has if it
        re-registers and that still fits it, else the policy's (``assignment.py``) among the
        other peers' stages."""
        stage = self.assigned.get(peer)
        if stage is not None and stage in self.fits(fits):
            return stage
        replicas: dict[int, list[float | None]] = {}
        for other, k in self.assigned.items():
            if other != peer:
                replicas.setdefault(k, []).append(self._throughput(other))
        return choose_stage(self.num_stages, self.min_replicas, replicas, fits)

    def assign(self, peer: str, fits: Collection[int] | None) -> int:
        """The peer's stage (``pick``). A registration (first or again: a restarted process)
        is out of the table until it says ready again: its stage service may have moved or
        lost its state."""
        stage = self.pick(peer, fits)
        if self.assigned.get(peer) != stage:
            self.left(peer)
        said = None if fits is None else tuple(sorted(set(fits)))
        if self.assigned.get(peer) == stage and peer in self.fits_of:
            # Registered again for the same stage (its stage worker asks for that stage only):
            # what fits it is everything it said for this stage (None: any).
            before = self.fits_of[peer]
            said = None if before is None or said is None else tuple(sorted({*before, *said}))
        self.fits_of[peer] = said
        self.assigned[peer] = stage
        self.moves.pop(peer, None)  # registered for its stage: nothing left to tell it
        self.ready.pop(peer, None)
        self.suspects.pop(peer, None)
        self._publish()
        return stage

    def left(self, peer: str) -> None:
        """The peer deregistered, was evicted or kicked: out of every record."""
        self.assigned.pop(peer, None)
        self.ready.pop(peer, None)
        self.suspects.pop(peer, None)
        self.beats.pop(peer, None)
        self.fits_of.pop(peer, None)
        self.moves.pop(peer, None)
        self._publish()

    def rebalance(self) -> list[tuple[str, int, int]]:
        """After a leave: while a served stage has no replica and another has several, move
        one (``assignment.choose_move``), recorded at once: the peer is assigned its new stage,
        out of the table until it says ready there, and told at its next heartbeat
        (``moves``). The moves made, as ``(peer, old stage, new stage)``."""
        made = []
        while True:
            throughput = {p: self._throughput(p) for p in self.assigned}
            move = choose_move(  # only a peer that serves (said ready) can build another stage
                self.num_stages, self.assigned, self.fits_of, throughput, movable=self.ready
            )
            if move is None:
                break
            peer, stage = move
            made.append((peer, self.assigned[peer], stage))
            self.assigned[peer] = stage
            self.ready.pop(peer, None)
            self.suspects.pop(peer, None)
            self.moves[peer] = stage
        if made:
            self._publish()
        return made

    # --- readiness, heartbeats, suspects --------------------------------------------------------

    def check_ready(self, ready: StageReady) -> None:
        """409 ``wrong_stage`` for a stage the peer was not assigned, 409 ``params_mismatch``
        for a table other than the stage's. Changes nothing."""
        assigned = self.assigned.get(ready.worker_id)
        if assigned is None or assigned != ready.stage:
            raise wrong_stage(ready.worker_id, ready.stage, -1 if assigned is None else assigned)
        self.check_table(ready.stage, ready.params)

    def mark_ready(self, ready: StageReady) -> int:
        """``POST /swarm/ready`` of a registered peer: ``check_ready``, then in the table (a
        ready peer was heard from, so a suspicion of it ends). The state a syncing stage's
        replica must hold is its quorum book's to check (``StageQuorums.refuse_unheld``),
        before this."""
        self.check_ready(ready)
        self.tables.setdefault(ready.stage, ready.params)
        self.ready[ready.worker_id] = ready.address
        self.suspects.pop(ready.worker_id, None)
        self._publish()
        return self.version

    def check_table(self, stage: int, table: Table) -> None:
        """409 ``params_mismatch`` naming the differences when the stage's table is fixed and
        ``table`` is another; changes nothing (the caller fixes it, ``tables.setdefault``, once
        its request went through)."""
        agreed = self.tables.get(stage)
        if agreed is not None and agreed != table:
            raise mismatch(
                differences(agreed, table),
                f"Every replica of stage {stage} must host the same stage module",
            )

    def heard(self, peer: str, beat: SwarmBeat | None) -> None:
        """A heartbeat of a registered peer: alive again after any report, and its
        measurements (absent: the last ones stay)."""
        self.suspects.pop(peer, None)
        if beat is not None:
            last = self.beats.get(peer)
            if beat.throughput is None and last is not None:
                beat = replace(beat, throughput=last.throughput)
            self.beats[peer] = beat
        self._publish()

    def report(self, report: SuspectReport) -> int:
        """``POST /swarm/suspect`` from a registered peer. A suspect no longer assigned is
        already out (nothing to do); one of another stage is 409 ``wrong_stage``."""
        stage = self.assigned.get(report.suspect)
        if stage is not None and stage != report.stage:
            raise wrong_stage(report.suspect, report.stage, stage)
        self.suspect_reports += 1
        if stage is not None:
            self.suspects[report.suspect] = Suspicion(report.worker_id, report.reason, self.clock())
            self._publish()
        return self.version

    # --- the route table ------------------------------------------------------------------------

    def _throughput(self, peer: str) -> float | None:
        beat = self.beats.get(peer)
        return beat.throughput if beat is not None else None

    def live(self, stage: int) -> list[str]:
        """The stage's replicas in the table, fastest reported first (unreported last)."""
        peers = [
            p
            for p, k in self.assigned.items()
            if k == stage and p in self.ready and p not in self.suspects
        ]
        return sorted(peers, key=lambda p: (-(self._throughput(p) or -1.0), p))

    def _build(self) -> tuple[StageRoutes, ...]:
        return tuple(
            StageRoutes(
                stage=k,
                replicas=tuple(
                    Replica(peer_id=p, address=self.ready[p], throughput=self._throughput(p))
                    for p in self.live(k)
                ),
            )
            for k in range(self.num_stages)
        )

    def _publish(self) -> None:
        table = self._build()
        if table != self._table:
            self._table = table
            self.version += 1
            if self._wakeup is not None:
                self._wakeup.notify()

    def routes(self) -> RouteTable:
        return RouteTable(version=self.version, num_stages=self.num_stages, stages=self._table)

    async def wait(self, version: int, timeout: float) -> RouteTable:
        """The table once its version is not ``version``, or after ``timeout`` seconds."""
        if self._wakeup is None:
            self._wakeup = Wakeup()
        wakeup = self._wakeup
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(wakeup.until(lambda: self.version != version), timeout)
        return self.routes()

    # --- status ---------------------------------------------------------------------------------

    def public(self) -> SwarmStatus:
        now = self.clock()
        traffic: dict[tuple[int, str], list[int]] = {}
        for beat in self.beats.values():
            for b in beat.boundaries:
                sums = traffic.setdefault((b.boundary, b.direction), [0, 0])
                sums[0] += b.bytes
                sums[1] += b.tokens
        return SwarmStatus(
            num_stages=self.num_stages,
            min_replicas=self.min_replicas,
            version=self.version,
            stages=tuple(self._stage(k) for k in range(self.num_stages)),
            boundaries=tuple(
                BoundaryStatus(b, d, n, t, round(n / t, 3) if t else None)
                for (b, d), (n, t) in sorted(traffic.items())
            ),
            reroutes=sum(b.reroutes for b in self.beats.values()),
            recoveries=sum(b.recoveries for b in self.beats.values()),
            recomputes=sum(b.recomputes for b in self.beats.values()),
            suspects=tuple(
                SuspectStatus(
                    p, self.assigned.get(p, -1), s.reporter, s.reason, round(now - s.at, 3)
                )
                for p, s in sorted(self.suspects.items())
            ),
            suspect_reports=self.suspect_reports,
        )

    def _stage(self, stage: int) -> StageStatus:
        peers = sorted(p for p, k in self.assigned.items() if k == stage)
        table = self.tables.get(stage, ())
        numel = 0
        for _, shape in table:
            n = 1
            for d in shape:
                n *= d
            numel += n
        return StageStatus(
            stage=stage,
            assigned=tuple(peers),
            ready=tuple(sorted(self.live(stage))),
            throughput=stage_throughput([self._throughput(p) for p in peers]) if peers else None,
            num_params=numel,
        )
