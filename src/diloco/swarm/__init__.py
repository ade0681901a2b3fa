"""Pipeline swarm, the peer side (issue 29): a model split into stages across machines.

Built so far: the data plane. ``split`` cuts an ``nn.Sequential`` into named stages,
``boundary`` is what crosses between stages (codecs, shapes, bytes per token),
``stage_service`` serves one stage over HTTP, ``driver`` pushes micro-batches through the
stages from a head replica with failover, ``routing`` picks replicas. ``SwarmPeer`` (``peer``)
joins a coordinator (``diloco server --swarm``), builds and serves its assigned stage or drives
the swarm from the head, with ``CoordinatorRoutes`` (the coordinator's route table); with
``sync_every`` a stage's replicas average it with DiLoCo (docs/design/swarm.md).
"""

from diloco.swarm.boundary import BoundaryCodec, BoundarySpec, Compressor, Traffic
from diloco.swarm.coordinator_routes import CoordinatorRoutes
from diloco.swarm.driver import CallFailed, Driver, StageCallError
from diloco.swarm.peer import SwarmPeer
from diloco.swarm.routing import Endpoint, NoReplica, Picker, Routes, StaticRoutes
from diloco.swarm.split import Stage, split_sequential, stage_of
from diloco.swarm.stage_service import StageEdges, StageService

__all__ = [
    "BoundaryCodec",
    "BoundarySpec",
    "CallFailed",
    "CoordinatorRoutes",
    "Compressor",
    "Driver",
    "Endpoint",
    "NoReplica",
    "Picker",
    "Routes",
    "Stage",
    "StageCallError",
    "StageEdges",
    "StageService",
    "StaticRoutes",
    "SwarmPeer",
    "Traffic",
    "split_sequential",
    "stage_of",
]
