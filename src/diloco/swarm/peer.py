"""SwarmPeer: one peer of a pipeline swarm that joins through the coordinator
(``diloco server --swarm``).

``start()`` registers (saying which stages fit it, if it says), learns its stage ``k``, builds
ONLY that stage (``build_stage(k, S)``: the full model never exists here), serves it with a
``StageService`` unless it is the head (head replicas are drivers and serve nothing), says it is
ready with the stage's parameter table, its service's address and, with stage sync, the
stage's state it holds (``POST /swarm/ready``, ``_say_ready``: a table other than the stage's,
or a state the stage did not agree on, is refused with 409 and the peer leaves, leaving nothing
in the route table), then heartbeats its measurements. A head peer's ``train_step(x, y)`` runs the
``Driver`` over ``CoordinatorRoutes``; any other peer's ``serve()`` blocks until ``stop()`` (or
SIGTERM) and leaves. ``stop()`` deregisters and may be called any number of times.

Stage sync (``sync_every=H``): once its stage and optimizer exist, the peer runs a
``DiLoCoWorker`` over them under the peer's own id (its registration again keeps the stage and
carries the stage's table; its first quorum hands a joiner the stage's agreed state before the
peer says ready). The worker's hook fires where the stage's optimizer steps: on the stage
service's compute thread (body, tail), after the reply of the call that completed the step, or
on the thread calling ``train_step`` (head). While a replica steps through a round its service
answers 503 ``syncing`` and drivers wait (``Driver.busy_wait_s``: the stage's collective
timeout), never reporting it suspect. A serving replica that has not stepped for
``idle_step_s`` (no driver calls it) takes a step with no gradient, so its stage's rounds never
wait for it; the step holds 0 samples (weight 0 under ``--weighting samples``). The peer's
heartbeats are its own loop (``PeerBeats``): the worker runs none. Without ``sync_every`` each
replica trains its stage on the micro-batches it is sent and nothing more.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import CancelledError
from typing import Any

import torch
from torch import nn

from diloco.swarm.boundary import BoundaryCodec, BoundarySpec
from diloco.swarm.coordinator_routes import CoordinatorRoutes
from diloco.swarm.driver import Driver
from diloco.swarm.peer_beats import PeerBeats
from diloco.swarm.peer_life import PeerLife, restore_stage, serve_until_stopped
from diloco.swarm.routing import NoReplica
from diloco.swarm.stage_service import Hook, LossFn, StageEdges, StageService
from diloco.wire.messages import Registered, RegisterInfo, Table
from diloco.wire.messages.swarm import StageAccepted
from diloco.worker.state.start_state import StartState
from diloco.worker.transport.client import SYNC_FAILURES, DiLoCoClient
from diloco.worker.worker import DiLoCoWorker

log = logging.getLogger(__name__)

BuildStage = Callable[[int, int], nn.Module]
"""``build_stage(k, S)``: stage ``k`` of ``S`` as a module named as in the unsplit model."""
OptimizerFactory = Callable[[Any], torch.optim.Optimizer]
"""``optimizer(params)``: the stage's inner optimizer over its parameters."""


def table_of(module: nn.Module) -> Table:
    """A module's parameter table, ``((name, shape), ...)`` in its order."""
    return tuple((name, tuple(p.shape)) for name, p in module.named_parameters())


def boundary_codecs(
    shapes: Sequence[tuple[int, ...]], codec: str
) -> list[tuple[BoundaryCodec, BoundaryCodec]]:
    """The ``(forward, backward)`` codecs of each boundary from its trailing shape."""
    out = []
    for b, tail in enumerate(shapes):
        spec = BoundarySpec(f"{b}->{b + 1}", tuple(tail))
        out.append((BoundaryCodec(spec, codec), BoundaryCodec(spec, codec)))
    return out


class SwarmPeer:
    """A swarm peer. ``boundaries`` is each boundary's trailing shape (past the micro-batch
    dimension), ``S - 1`` of them, or one shape for all (``(hidden,)``); ``samples_per_step``
    is the driver's batch: a body or tail replica steps its optimizer once it has applied that
    many samples' backwards. ``loss_fn`` is used if the peer becomes the tail. ``stages``: the
    stages that fit this peer (None: any). ``sync_every``: stage sync every that many inner
    steps (None: none); ``sync_options`` are more ``DiLoCoWorker`` settings for it (default
    fp32 pseudo-gradients: ``bf16_comm=False``); ``idle_step_s``: a serving replica that has
    not stepped for this long takes a step with no gradient (stage sync only); ``restore_dir``:
    the save dir whose ``stage-<k>/`` a peer moved to stage ``k`` restores from (default the
    stage sync's ``save_dir``); ``announce``: the host drivers dial, said in the ready (default
    ``host``; required when ``host`` binds every interface, which no one can dial)."""

    def __init__(
        self,
        build_stage: BuildStage,
        *,
        num_stages: int,
        server: str,
        optimizer: OptimizerFactory,
        loss_fn: LossFn,
        boundaries: tuple[int, ...] | Sequence[tuple[int, ...]],
        samples_per_step: int,
        micro_batch: int = 1,
        codec: str = "int8",
        token: str | None = None,
        stages: Sequence[int] | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        announce: str | None = None,
        sync_every: int | None = None,
        sync_options: Mapping[str, Any] | None = None,
        restore_dir: str | None = None,
        idle_step_s: float = 10.0,
        max_in_flight: int = 1,
        heartbeat_interval: float = 5.0,
        route_wait_s: float = 60.0,
        timeout_floor_s: float = 1.0,
        first_timeout_s: float = 30.0,
        token_dims: int = 1,
        worker_id: str | None = None,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        hook: Hook | None = None,
        seed: int = 0,
    ) -> None:
        if sync_every is not None and sync_every < 1:
            raise ValueError("sync_every must be at least 1 (or None: no stage sync)")
        if not idle_step_s > 0:
            raise ValueError("idle_step_s must be positive")
        if num_stages < 2:
            raise ValueError("a swarm has at least 2 stages")
        if samples_per_step < 1 or micro_batch < 1 or max_in_flight < 1:
            raise ValueError("samples_per_step, micro_batch and max_in_flight must be >= 1")
        shapes = _shapes(boundaries, num_stages)
        self.build_stage, self.num_stages = build_stage, num_stages
        self.optimizer_factory = optimizer
        self.loss_fn, self.samples_per_step, self.micro_batch = (
            loss_fn,
            samples_per_step,
            micro_batch,
        )
        self.edges = boundary_codecs(shapes, codec)  # a bad codec or shape fails here, not later
        self.token, self.fits = token, tuple(stages) if stages is not None else None
        if announce is None and host in ("0.0.0.0", "::", ""):
            raise ValueError(
                f"host {host!r} binds every interface, which no driver can dial: give announce "
                "(diloco swarm-peer --announce), the address the other machines reach this one at"
            )
        self.host, self.port, self.max_in_flight = host, port, max_in_flight
        self.announce = announce or host
        self.heartbeat_interval, self.route_wait_s = heartbeat_interval, route_wait_s
        self.timeout_floor_s, self.first_timeout_s = timeout_floor_s, first_timeout_s
        self.token_dims, self.hook, self.seed, self.wanted_id = token_dims, hook, seed, worker_id
        self.client = DiLoCoClient(server, token=token, tls_ca=tls_ca)
        self.server, self.tls_ca, self.sync_every = server, tls_ca, sync_every
        # The stage service's HTTPS (its drivers verify it with their ``tls_ca``).
        self.tls_cert, self.tls_key = tls_cert, tls_key
        self.sync_options = {"bf16_comm": False, **(sync_options or {})}
        self.idle_step_s = idle_step_s
        self.restore_dir = restore_dir or self.sync_options.get("save_dir")
        #: The stage's DiLoCo worker (stage sync), once started.
        self.worker: DiLoCoWorker | None = None
        self._idler: threading.Thread | None = None
        self._busy_wait_s = 60.0
        self.worker_id: str | None = None
        self.stage: int | None = None
        #: Its stage service's address as its ready says it (the head's names port 0).
        self.address: str | None = None
        self.life: PeerLife | None = None
        self.module: nn.Module | None = None
        self.service: StageService | None = None
        self.driver: Driver | None = None
        self.routes: CoordinatorRoutes | None = None
        self._beats: PeerBeats | None = None
        self._samples = 0  # the head's: samples it drove through the swarm
        self._stopped = threading.Event()
        self._left = False
        self._lock = threading.Lock()

    # --- joining -------------------------------------------------------------------------------

    def start(self) -> SwarmPeer:
        """Join: register, build and serve the assigned stage, say ready, heartbeat. Raises
        ``Conflict`` (409 ``params_mismatch``) when the stage module does not match the stage's
        table, after leaving the run; ``ValueError`` when the server is not a swarm of
        ``num_stages`` stages."""
        info = RegisterInfo(
            pid=os.getpid(), heartbeat_interval=self.heartbeat_interval, stages=self.fits
        )
        reg = Registered.from_json(self.client.register(self.wanted_id, info=info))
        self.worker_id = reg.worker_id
        try:
            if reg.mode != "swarm" or reg.stage is None:
                raise ValueError(f"the server runs in {reg.mode} mode, not swarm mode")
            if reg.num_stages != self.num_stages:
                raise ValueError(
                    f"the swarm has {reg.num_stages} stages; this peer was built for "
                    f"{self.num_stages}"
                )
            self._take_stage(reg)
            self._say_ready()
        except BaseException:
            self.stop()
            raise
        self.life = PeerLife(self)
        self._beats = PeerBeats(
            self.client, reg.worker_id, self.heartbeat_interval, self.stats, self._processed,
            after=self.life.after_beat,
        )  # fmt: skip
        self._beats.start()
        self._start_idler()
        return self

    def _take_stage(self, reg: Registered, *, restore: bool = False) -> str:
        """Build, restore (a move: ``peer_life.py``), sync and serve (or drive) the stage
        ``reg`` assigns; the service's address."""
        assert reg.stage is not None
        self.stage = k = reg.stage
        self.module = self.build_stage(k, self.num_stages)
        found = None
        if restore:
            found = restore_stage(self.module, self.restore_dir, k, agreed_rounds=reg.round or 0)
        opt = self.optimizer_factory(self.module.parameters())
        if self.sync_every is not None:
            self._busy_wait_s = reg.collective_timeout or self._busy_wait_s
            start = None if found is None else StartState.of_checkpoint(found)
            self.worker = self._stage_worker(opt, start)
        self.address = self._serve_or_drive(k, opt)
        return self.address

    def _drop_stage(self) -> None:
        """Stop serving (or driving) and syncing the stage, still registered (a move)."""
        self._stop_work(leave=False)
        self.service = self.driver = self.routes = self.worker = self._idler = None
        self.module = None

    def _start_idler(self) -> None:
        if self.worker is not None and self.service is not None:
            self._idler = threading.Thread(target=self._idle_loop, name="swarm-idle", daemon=True)
            self._idler.start()

    def _say_ready(self) -> StageAccepted:
        """``POST /swarm/ready``: this peer's stage, its table, its address and, with stage
        sync, the stage's state its worker holds (round, hash), so the coordinator lists it
        only holding a state its stage agreed on (409 ``state_required``, ``unagreed_state``
        otherwise; ``params_mismatch``, ``wrong_stage``). The one place a peer says ready: at
        start, after the coordinator forgot it, after a move (``peer_life.py``)."""
        assert self.module is not None and self.worker_id is not None
        assert self.stage is not None and self.address is not None
        state = self.worker.held_state() if self.worker is not None else None
        accepted = StageAccepted.from_json(
            self.client.stage_ready(
                self.worker_id, stage=self.stage, params=table_of(self.module),
                address=self.address, state=state,
            )
        )  # fmt: skip
        log.info(
            "swarm peer %s: stage %d of %d ready at %s (table version %d%s)",
            self.worker_id, self.stage, self.num_stages, self.address, accepted.version,
            "" if state is None else f", round {state[0]}",
        )  # fmt: skip
        if self.life is not None:
            self.life.said_ready()
        return accepted

    def _stage_worker(self, opt: torch.optim.Optimizer, start: StartState | None) -> DiLoCoWorker:
        """The stage's DiLoCo worker, started under this peer's id (the stage kept), joined from
        ``start`` (a restored checkpoint's state) or from the stage's agreed state. Its
        heartbeats are the peer's own loop, so it runs none (``heartbeat_interval=0``)."""
        assert self.module is not None and self.stage is not None
        return DiLoCoWorker(
            self.module, opt, self.server, sync_every=self.sync_every, worker_id=self.worker_id,
            token=self.token, tls_ca=self.tls_ca, stages=(self.stage,), start_state=start,
            **{**self.sync_options, "heartbeat_interval": 0.0},
        ).start()  # fmt: skip

    def _idle_loop(self) -> None:
        """Stage sync on a serving replica: a step with no gradient after ``idle_step_s``
        without one, so its stage's rounds never wait on a replica no driver calls."""
        service = self.service
        assert service is not None
        while not self._stopped.is_set():
            left = self.idle_step_s - service.gate.idle_for()
            if left > 0:
                self._stopped.wait(left)
                continue
            try:
                service.step_idle()
            except (RuntimeError, CancelledError):  # the service stopped (the peer leaves)
                return

    def _serve_or_drive(self, k: int, opt: torch.optim.Optimizer) -> str:
        assert self.module is not None and self.worker_id is not None
        if k == 0:
            self.routes = CoordinatorRoutes(self.client, self.worker_id, self.token).start()
            self.driver = Driver(
                self.module, opt, self.routes, self.edges,
                micro_batch=self.micro_batch, max_in_flight=self.max_in_flight,
                timeout_floor_s=self.timeout_floor_s, first_timeout_s=self.first_timeout_s,
                token_dims=self.token_dims, driver_id=self.worker_id, seed=self.seed,
                busy_wait_s=self._busy_wait_s, tls_ca=self.tls_ca,
            )  # fmt: skip
            # The head serves nothing: port 0 names its host and says no one may dial it.
            return f"http://{_url_host(self.announce)}:0"
        tail = k == self.num_stages - 1
        self.service = StageService(
            self.module, opt,
            StageEdges(self.edges[k - 1], None if tail else self.edges[k], self.token_dims),
            samples_per_step=self.samples_per_step, token=self.token,
            loss_fn=self.loss_fn if tail else None, host=self.host, port=self.port,
            hook=self.hook, before_step=self._before_step, defer_steps=self.worker is not None,
            tls_cert=self.tls_cert, tls_key=self.tls_key,
        ).start()  # fmt: skip
        scheme = "https" if self.tls_cert else "http"
        return f"{scheme}://{_url_host(self.announce)}:{self.service.port}"

    # --- working -------------------------------------------------------------------------------

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """A head peer: one step of the batch ``(x, y)`` through the swarm; its mean loss.
        Waits up to ``route_wait_s`` for every stage to have a live replica (``NoReplica``)."""
        if self.driver is None or self.routes is None:
            raise RuntimeError("train_step is for a started head peer (stage 0)")
        if not self.routes.wait_for(range(1, self.num_stages), self.route_wait_s):
            raise NoReplica(f"no whole pipeline in the route table after {self.route_wait_s} s")
        if self.worker is not None:  # the step's weight in its stage's round
            self.worker.report(samples=int(x.shape[0]))
        loss = self.driver.train_step(x, y)
        with self._lock:
            self._samples += int(x.shape[0])
        return loss

    def _before_step(self, samples: int) -> None:
        if self.worker is not None:
            self.worker.report(samples=samples)

    def serve(self) -> None:
        """A peer that is not the head: block until ``stop()`` or SIGTERM, then leave."""
        if self.service is None:
            raise RuntimeError("serve is for a started peer that is not the head")
        serve_until_stopped(self._stopped)
        self.stop()

    @property
    def stopping(self) -> bool:
        return self._stopped.is_set()

    def stop(self) -> None:
        """Leave: stop heartbeats, routes and the service, deregister. Idempotent."""
        with self._lock:
            if self._left:
                return
            self._left = True
        self._stopped.set()
        if self._beats is not None:
            self._beats.stop()
        self._stop_work(leave=True)
        if self.worker is None and self.worker_id is not None:
            try:
                self.client.deregister(self.worker_id)
            except SYNC_FAILURES as exc:
                log.warning("swarm peer %s: deregister failed: %s", self.worker_id, exc)
        self.client.close()

    def _stop_work(self, *, leave: bool) -> None:
        """Stop routes, service, idle steps, driver and stage worker (deregistering: ``leave``)."""
        if self.routes is not None:
            self.routes.stop()
        if self.service is not None:
            self.service.stop()
        if self._idler is not None:
            self._idler.join(timeout=10)  # an idle step in flight is bounded by its round
        if self.driver is not None:
            self.driver.close()
        if self.worker is not None:  # leaves its stage's quorums (and deregisters the peer)
            self.worker.stop(submit=False, leave=leave)

    # --- observation ---------------------------------------------------------------------------

    def _processed(self) -> int:
        if self.service is not None:
            return int(self.service.stats()["steps"]) * self.samples_per_step
        with self._lock:
            return self._samples

    def stats(self) -> dict[str, Any]:
        """The driver's or the service's stats (``sent``: bytes and tokens per boundary and
        direction this peer sent), with ``stage``."""
        got: dict[str, Any] = {}
        if self.driver is not None:
            got = self.driver.stats()
        elif self.service is not None:
            got = self.service.stats()
        return {**got, "stage": self.stage}

    def beat(self) -> None:
        """Heartbeat now (tests: the status then holds what was sent so far)."""
        if self._beats is not None:
            self._beats.beat()


def _shapes(
    boundaries: tuple[int, ...] | Sequence[tuple[int, ...]], num_stages: int
) -> list[tuple[int, ...]]:
    """One trailing shape per boundary: ``(32,)`` is every boundary's."""
    if boundaries and all(isinstance(d, int) for d in boundaries):
        return [tuple(int(d) for d in boundaries)] * (num_stages - 1)  # type: ignore[arg-type]
    shapes: list[tuple[int, ...]] = []
    for shape in boundaries:
        if isinstance(shape, int):
            raise ValueError("boundaries: one shape (32,) or one tuple per boundary, not a mix")
        shapes.append(tuple(shape))
    if len(shapes) != num_stages - 1:
        raise ValueError(f"{num_stages} stages have {num_stages - 1} boundaries, not {len(shapes)}")
    return shapes


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
