"""What ``GET /status`` shows of swarm mode (``Status.swarm``; ``server/swarm/``): the stages,
their replicas, throughput, the boundaries' bytes and the drivers' reroutes as the peers report
them in their heartbeats, and the replicas reported suspect."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StageStatus:
    """One pipeline stage."""

    stage: int
    assigned: tuple[str, ...]  # peers registered for it
    ready: tuple[str, ...]  # of those, in the route table now (ready, alive, not suspect)
    throughput: float | None  # samples/s its replicas reported together (None: not yet)
    num_params: int  # elements of its agreed table (0: none fixed yet)
    round: int = 0  # of the state its replicas' last quorum agreed on (stage sync)
    rounds_completed: int = 0  # its quorums that advanced the stage's round


@dataclass(frozen=True)
class BoundaryStatus:
    """Bytes sent across one boundary in one direction by the live peers, since they
    started."""

    boundary: int  # between stage ``boundary`` and ``boundary + 1``
    direction: str  # forward (activations) or backward (their gradients)
    bytes: int
    tokens: int
    bytes_per_token: float | None  # None before any token crossed


@dataclass(frozen=True)
class SuspectStatus:
    """A replica a driver reported, out of the route table until it heartbeats again."""

    peer_id: str
    stage: int
    reporter: str
    reason: str
    age_s: float


@dataclass(frozen=True)
class SwarmStatus:
    """Swarm mode's section of the status."""

    num_stages: int
    min_replicas: int
    version: int  # the route table's
    stages: tuple[StageStatus, ...]
    boundaries: tuple[BoundaryStatus, ...] = ()
    reroutes: int = 0  # the live drivers' together
    recoveries: int = 0
    recomputes: int = 0  # the live replicas' together: held forwards run again (several drivers)
    suspects: tuple[SuspectStatus, ...] = ()
    suspect_reports: int = 0  # received since the server started
