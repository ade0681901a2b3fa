"""Swarm mode's coordinator routes (``diloco server --swarm``): the bodies of ``POST
/swarm/ready`` (``StageReady``, answered by ``StageAccepted``), ``GET /swarm/routes``
(answered by ``RouteTable``) and ``POST /swarm/suspect`` (``SuspectReport``, answered by
``SuspectNoted``). Registration and heartbeats are the run's own (``registration.py``: a peer
names the stages that fit it in ``RegisterInfo.stages``, is told its ``Registered.stage``, and
reports its measurements in ``Heartbeat.swarm``).

A peer is in the route table once it said it is ready (its stage service listens, its stage's
parameters match the stage's table) and for as long as it heartbeats and no driver reported it
suspect since its last heartbeat.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Self
from urllib.parse import urlsplit

from diloco.wire.messages.codec import MessageError, Reply, Request, Rule, at_least, spec, text
from diloco.wire.messages.quorums import HASH_LIMIT
from diloco.wire.messages.registration import TABLE, Table

PATH = "/swarm"
"""Where the coordinator's swarm routes live: ``<PATH>/ready``, ``/routes``, ``/suspect``."""
ADDRESS_LIMIT = 256
REASON_LIMIT = 500


def _address_ok(value: str) -> bool:
    if len(value) > ADDRESS_LIMIT:
        return False
    try:
        parts = urlsplit(value)
        port = parts.port  # a ValueError for a port out of range
    except ValueError:
        return False
    return (
        parts.scheme in ("http", "https")
        and bool(parts.hostname)
        and port is not None
        and parts.path in ("", "/")
        and not (parts.query or parts.fragment or parts.username or parts.password)
    )


ADDRESS = Rule(
    f"a stage service's base URL, http(s)://host:port, at most {ADDRESS_LIMIT} characters",
    _address_ok,
)


@dataclass(frozen=True)
class StageReady(Request):
    """``POST /swarm/ready``: the peer's stage service listens at ``address`` and holds
    ``params``; it may enter the route table."""

    worker_id: str = spec(rule=text())
    """The registered peer."""
    stage: int = spec(rule=at_least(0))
    """The stage it hosts: the one its registration was assigned."""
    params: Table = spec(rule=TABLE)
    """Its stage module's parameter table (the unsplit model's names): the stage's first
    ready peer fixes the stage's table, a differing one is refused (409)."""
    address: str = spec(rule=ADDRESS)
    """Its stage service's base URL, as drivers dial it (``http://10.0.0.7:8700``)."""
    round: int | None = spec(default=None, omit=True, rule=at_least(0))
    """Stage sync: the round of the stage's state the peer holds (its quorums' ``round``);
    absent: it holds none it can vouch for (it does not sync)."""
    state_hash: str | None = spec(default=None, omit=True, rule=text(HASH_LIMIT))
    """That state's hash, as the peer's ``POST /quorum`` presents it
    (``worker/allreduce/collective.py`` ``state_hash``); given with ``round`` or not at all. A
    stage whose replicas agreed on states takes a ready only holding one of them (409
    ``state_required``, ``unagreed_state``)."""

    def checked(self) -> Self:
        if (self.round is None) != (self.state_hash is None):
            field = "state_hash" if self.state_hash is None else "round"
            raise MessageError(field, "give 'round' and 'state_hash' together, or neither")
        return self

    @property
    def state(self) -> tuple[int, str] | None:
        """The (round, hash) presented; None: none."""
        if self.round is None or self.state_hash is None:
            return None
        return self.round, self.state_hash


@dataclass(frozen=True, kw_only=True)
class StageAccepted(Reply):
    """The reply to ``StageReady``."""

    stage: int
    """The stage the peer serves."""
    version: int
    """The route table's version that holds it."""


@dataclass(frozen=True, kw_only=True)
class Replica(Reply):
    """One live, ready replica of a stage."""

    peer_id: str
    """Its worker id."""
    address: str
    """Its stage service's base URL."""
    throughput: float | None = None
    """Samples per second it reported lately (None: not yet)."""


@dataclass(frozen=True, kw_only=True)
class StageRoutes(Reply):
    """A stage's live replicas, the fastest reported first."""

    stage: int
    """The stage."""
    replicas: tuple[Replica, ...] = ()
    """Its replicas drivers may call (empty: none now; a driver waits)."""


@dataclass(frozen=True, kw_only=True)
class RouteTable(Reply):
    """The reply to ``GET /swarm/routes?version=N``: at once when the table's version is not
    ``N``, else when it changes or the long poll ends (then the same version again)."""

    version: int
    """Increases on every change of the table (a replica in or out, a throughput reported)."""
    num_stages: int
    """The pipeline's stages."""
    stages: tuple[StageRoutes, ...] = ()
    """One entry per stage, in stage order."""


@dataclass(frozen=True)
class SuspectReport(Request):
    """``POST /swarm/suspect``: a driver's call to ``suspect`` failed (a reset, a refusal, a
    5xx, a timeout); the coordinator leaves it out of the table until it heartbeats again."""

    worker_id: str = spec(rule=text())
    """The reporting peer (registered)."""
    suspect: str = spec(rule=text())
    """The replica's peer id."""
    stage: int = spec(rule=at_least(0))
    """The stage the failed call was for (must be the suspect's)."""
    reason: str = spec(default="", rule=text(REASON_LIMIT, empty=True))
    """What failed, for the log and ``/status``."""


@dataclass(frozen=True, kw_only=True)
class SuspectNoted(Reply):
    """The reply to ``SuspectReport``."""

    version: int
    """The route table's version now (without the suspect)."""
