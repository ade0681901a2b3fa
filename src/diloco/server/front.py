"""What the web layer, the control routes and ``DiLoCoServer`` know of a mode: one ``Front``.

Each mode of the server is one front object behind this protocol: the parameter server (sync,
async, streaming fragments: ``server/paramserver/coordinator.py``) and all-reduce mode
(``server/allreduce/allreduce_front.py``: the workers average among themselves, the server forms
their quorums and holds no parameters) and swarm mode (``server/swarm/swarm_front.py``: a
pipeline's stages live on the peers, the server assigns them and serves the route table). ``DiLoCoServer`` picks one in one place
(``server/server.py``, ``make_front``); nothing else asks which mode runs.

Every route is mounted in every mode. A route of the other mode is answered by the front itself,
before any byte of its body is read: ``parameters`` and ``quorums`` either hand over the routes'
side or raise the 409 that names the mode (``allreduce_mode``, ``server_mode``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Protocol

from diloco.server.config import ServerConfig
from diloco.server.observe.metrics import Family
from diloco.server.observe.status import Status
from diloco.server.params.store import ParamStore, Snapshot
from diloco.wire import Layout
from diloco.wire.decode import AsyncStream
from diloco.wire.messages import (
    Assignment,
    Deregistered,
    Heartbeat,
    HeartbeatReply,
    Kicked,
    NumWorkersUpdated,
    OptimizerUpdated,
    OutcomeRecorded,
    ParamsSeeded,
    Pending,
    QuorumAsk,
    QuorumOutcome,
    Register,
    Registered,
    Saved,
    SaveRequested,
    UploadReceipt,
)
from diloco.wire.messages.swarm import (
    RouteTable,
    StageAccepted,
    StageReady,
    SuspectNoted,
    SuspectReport,
)

JSON_LIMIT = 64 * 1024
"""Largest JSON body accepted (registration, heartbeat, control): they hold a few fields. A
front may let registrations be larger (``Front.register_limit``)."""


class Members(Protocol):
    """Registrations, heartbeats and leaving (``server/members/membership.py``), the same in
    every mode; what a registration means to the mode is the front's."""

    def register(self, asked: Register, hostname: str) -> Registered:
        """``POST /register`` from ``hostname`` (a new id when ``asked`` names none). Checked
        before anything changes: 400, 409 or 422 leave no trace."""
        ...

    def deregister(self, worker_id: str, *, died: bool = False) -> Deregistered:
        """``POST /deregister`` (410 for a worker not registered)."""
        ...

    def heartbeat(self, beat: Heartbeat) -> HeartbeatReply:
        """``POST /heartbeat`` (410 for a worker not registered)."""
        ...

    def kick(self, worker_id: str) -> Kicked:
        """``POST /control/kick_worker``: evict a worker now (410 for one not registered)."""
        ...

    def set_num_workers(self, num_workers: int) -> NumWorkersUpdated:
        """``POST /control/update_num_workers``: the workers the run expects (400 below
        ``min_workers``)."""
        ...


class Parameters(Protocol):
    """The routes of a front that holds the global parameters: uploads, downloads, the outer
    optimizer."""

    def require_store(self) -> ParamStore:
        """The parameters (503 ``no_parameters`` until the server has them)."""
        ...

    def upload_limit(self) -> int:
        """Largest tensor payload taken now: the model's size, or ``max_initial_bytes`` while
        the initial parameters are awaited."""
        ...

    async def submit(self, layout: Layout, stream: AsyncStream) -> UploadReceipt:
        """``POST /submit_pseudograd`` whose header is ``layout``: the body read from
        ``stream`` and counted, or refused (409, 410, 422...) with nothing counted."""
        ...

    async def receive_initial(
        self, layout: Layout, stream: AsyncStream, worker_id: str
    ) -> ParamsSeeded:
        """``POST /initial_params``: the first worker's parameters, when the server has none."""
        ...

    async def download(
        self,
        worker_id: str | None,
        raw_fragment: str | None,
        min_round: Callable[[], int],
        have_round: int | None = None,
    ) -> Snapshot | Pending:
        """``GET /global_params``: the pinned bytes to stream once a round >= ``min_round()``
        is published, or the 202 reply when none is within ``poll_timeout``. The caller
        closes the snapshot (``ParamStore.close_snapshot``) and calls its ``sent`` once sent."""
        ...

    def set_outer_hparams(
        self, lr: float | None = None, momentum: float | None = None
    ) -> OptimizerUpdated:
        """``POST /control/update_optimizer``: every outer optimizer's learning rate and/or
        momentum, validated before anything changes."""
        ...


class QuorumKeys(Protocol):
    """All-reduce mode's rendezvous (``server/allreduce/rendezvous.py``'s ``RendezvousStore``):
    a quorum's keys, for a member of it only; each call raises the ``ApiError`` that refuses
    it (400, 403, 404, 410, 413) before anything changes. ``position`` (keyword, 0 unless said)
    names the key space within the quorum: one per rank position of sharded worker groups."""

    def set(
        self, worker: str, quorum_id: str, key: str, value: bytes, *, position: int = 0
    ) -> None: ...

    async def get(
        self, worker: str, quorum_id: str, key: str, wait: float, *, position: int = 0
    ) -> bytes | None:
        """The value once set within ``wait`` seconds (bounded by the store), else None."""
        ...

    def add(
        self, worker: str, quorum_id: str, key: str, amount: int, *, position: int = 0
    ) -> int: ...

    def compare_set(
        self,
        worker: str,
        quorum_id: str,
        key: str,
        expected: bytes,
        desired: bytes,
        *,
        position: int = 0,
    ) -> bytes: ...

    async def wait(
        self, worker: str, quorum_id: str, wanted: Iterable[str], wait: float, *, position: int = 0
    ) -> bool:
        """Every key of ``wanted`` set within ``wait`` seconds (bounded by the store)."""
        ...

    def delete(self, worker: str, quorum_id: str, key: str, *, position: int = 0) -> bool: ...

    def count(self, worker: str, quorum_id: str, *, position: int = 0) -> int: ...


class Quorums(Protocol):
    """The routes of a front whose workers average among themselves: their quorums."""

    def round_of(self, worker_id: str) -> int:
        """The round of the state ``worker_id``'s quorums hold (the run's; in swarm mode its
        stage's), named in a pending reply."""
        ...

    async def quorum(self, ask: QuorumAsk) -> Assignment | None:
        """``POST /quorum``: the worker's quorum, or None when none formed within
        ``poll_timeout`` (the worker asks again)."""
        ...

    def outcome(self, outcome: QuorumOutcome) -> OutcomeRecorded:
        """``POST /quorum/outcome``: one member's result, recorded."""
        ...

    @property
    def rendezvous(self) -> QuorumKeys | None:
        """``POST /rendezvous/<op>``: the quorums' keys (None before ``open``, after
        ``close``)."""
        ...


class Swarm(Protocol):
    """The routes of a front that coordinates a pipeline swarm (``server/swarm/``): each
    raises the ``ApiError`` that refuses it (400, 404, 409, 410) before anything changes."""

    def stage_ready(self, ready: StageReady) -> StageAccepted:
        """``POST /swarm/ready``: the peer's stage service enters the route table."""
        ...

    async def routes(self, version: int) -> RouteTable:
        """``GET /swarm/routes?version=N``: the table once its version is not ``N``, or when
        the long poll (``poll_timeout``) ends."""
        ...

    def suspect(self, report: SuspectReport) -> SuspectNoted:
        """``POST /swarm/suspect``: a driver's report; the suspect is out of the table until
        it heartbeats again."""
        ...


class Front(Protocol):
    """One mode of the server."""

    @property
    def config(self) -> ServerConfig:
        """The server's settings (tokens, limits and timeouts the web layer applies)."""
        ...

    @property
    def membership(self) -> Members:
        """Registrations, heartbeats, leaving, kicks and the expected worker count."""
        ...

    @property
    def register_limit(self) -> int:
        """Largest ``POST /register`` body this mode reads (``JSON_LIMIT``, or more where a
        registration carries a parameter table)."""
        ...

    @property
    def metric_families(self) -> Sequence[Family]:
        """The mode's own ``/metrics`` families, beside those every mode has."""
        ...

    def status(self, history_since: int = 0) -> Status:
        """``GET /status`` (its loss history from round ``history_since`` on), typed."""
        ...

    def parameters(self, what: str) -> Parameters:
        """The parameter routes' side; 409 ``allreduce_mode`` naming ``what`` the request
        asked for where the server holds no parameters."""
        ...

    def quorums(self) -> Quorums:
        """The quorum routes' side; 409 ``server_mode`` where the server holds the
        parameters. In swarm mode, each stage's replicas' quorums
        (``server/swarm/stage_quorums.py``)."""
        ...

    def swarm(self) -> Swarm:
        """The swarm routes' side; 409 ``not_swarm_mode`` where the server runs another
        mode."""
        ...

    async def request_save(self) -> tuple[int, Saved | SaveRequested]:
        """``POST /control/save_state``: the HTTP status and reply of a checkpoint asked for
        now (written by the server, or by the workers' next quorum)."""
        ...

    async def save(self) -> Path | None:
        """Write the server's own checkpoint now (on shutdown, ``DiLoCoServer.save_state``);
        None when saving is not configured or there is nothing to save."""
        ...

    def open(self) -> None:
        """The server listens: take what the mode hosts beside it (all-reduce mode's
        rendezvous). Called before any request is handled."""
        ...

    async def run(self) -> None:
        """The mode's periodic work while the server runs (health checks, quorum deadlines);
        cancelled on shutdown."""
        ...

    def close(self) -> None:
        """The server has stopped answering: release what ``open`` took."""
        ...
