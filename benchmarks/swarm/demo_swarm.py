"""The demo's character model as a 3-stage swarm in one process: a real ``--swarm``
coordinator (``DiLoCoServer`` on 127.0.0.1 port 0) and ``SwarmPeer``s in threads, each
building only its own stage of ``build_sequential(seed)``; the unsplit model trained the plain
way beside it. What ``pipeline.py`` measures runs through these.

Every peer is a thread of this process: the stage services, the head's driver and the server
share the GIL and torch's thread pool, as processes on a 2-core machine would share the cores.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from diloco import DiLoCoServer, ServerConfig
from diloco.demo.data import VOCAB_SIZE, sample_batch
from diloco.demo.model import evaluate
from diloco.demo.sequential import build_sequential
from diloco.swarm import SwarmPeer, stage_of
from diloco.swarm.stage_service import Hook

TOKEN = "swarm-benchmark-token"
STAGES = 3
SEQ, D_MODEL = 64, 64
"""Each boundary carries ``(SEQ, D_MODEL)`` per sample: the demo model's context and width."""


@dataclass(frozen=True)
class Setup:
    """One swarm configuration."""

    seed: int = 0
    batch: int = 16
    """Samples a step (the driver's batch; every stage steps once it applied them)."""
    micro_batch: int = 4
    in_flight: int = 4
    """Micro-batches the driver keeps in flight at once."""
    codec: str = "int8"
    lr: float = 3e-3
    timeout_floor_s: float = 5.0
    """The driver's least call timeout. The fault runs set it low (a frozen replica is left
    after about this); the throughput runs keep it high: with one replica per stage, a call
    that waits past half of it in a busy replica's queue (503 ``late``) leaves the stage with
    no live replica and fails the step (seen on this machine at 0.5 s, 4 in flight)."""


def build_stage(seed: int) -> Any:
    """``build_stage(k, S)`` of the demo model made from ``seed``."""
    return lambda k, s: stage_of(lambda: build_sequential(seed), k, s)


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.reshape(-1, VOCAB_SIZE), y.reshape(-1))


def start_server() -> DiLoCoServer:
    """A coordinator for 3 stages that evicts no one by the clock (the benchmark decides who
    leaves) and ends its long polls soon (peers stop promptly)."""
    config = ServerConfig(
        port=0, num_workers=1, swarm=True, stages=STAGES, min_replicas=1, token=TOKEN,
        poll_timeout=0.5, join_timeout=0.0, heartbeat_timeout=0.0,
    )  # fmt: skip
    return DiLoCoServer(config, initial_params=None).start()


def make_peer(address: str, fits: int, setup: Setup, hook: Hook | None = None) -> SwarmPeer:
    return SwarmPeer(
        build_stage(setup.seed), num_stages=STAGES, server=address,
        optimizer=lambda params: torch.optim.AdamW(params, lr=setup.lr), loss_fn=loss_fn,
        boundaries=(SEQ, D_MODEL), samples_per_step=setup.batch, micro_batch=setup.micro_batch,
        codec=setup.codec, token=TOKEN, stages=[fits], heartbeat_interval=0.0,
        max_in_flight=setup.in_flight, timeout_floor_s=setup.timeout_floor_s, token_dims=2,
        hook=hook, seed=setup.seed, route_wait_s=30.0,
    )  # fmt: skip


class Driven(Protocol):
    """A swarm as training sees it: its head peer, and a wait for its stages' work."""

    head: SwarmPeer

    def drain(self) -> None: ...


@dataclass
class Swarm:
    server: DiLoCoServer
    head: SwarmPeer
    stages: dict[int, list[SwarmPeer]] = field(default_factory=dict)

    def add(self, fits: int, setup: Setup, hook: Hook | None = None) -> SwarmPeer:
        peer = make_peer(self.server.address, fits, setup, hook).start()
        self.stages.setdefault(fits, []).append(peer)
        return peer

    def drain(self) -> None:
        """Wait until every live replica finished what it was sent."""
        for group in self.stages.values():
            for p in group:
                if p.service is not None and not p.stopping:
                    p.service.drain()

    def sent(self) -> dict[str, dict[str, float]]:
        """Bytes and tokens sent per ``boundary:direction``, summed over the peers (each byte
        is counted by its sender once)."""
        out: dict[str, dict[str, float]] = {}
        for p in [self.head, *(q for g in self.stages.values() for q in g)]:
            for key, row in p.stats().get("sent", {}).items():
                acc = out.setdefault(key, {"bytes": 0, "tokens": 0})
                acc["bytes"] += row["bytes"]
                acc["tokens"] += row["tokens"]
        return out

    def joined(self, seed: int, pick: dict[int, int] | None = None) -> nn.Sequential:
        """The unsplit model holding the head's and replica ``pick[k]`` (default 0) of each
        stage's parameters (the stages keep the unsplit model's names)."""
        params = {n: p.detach() for n, p in self.head.module.named_parameters()}  # type: ignore[union-attr]
        for k, group in self.stages.items():
            module = group[(pick or {}).get(k, 0)].module
            assert module is not None
            params.update({n: p.detach() for n, p in module.named_parameters()})
        model = build_sequential(seed)
        model.load_state_dict(params, strict=True)
        return model


@contextmanager
def swarm(
    setup: Setup,
    replicas: dict[int, int] | None = None,
    hooks: dict[tuple[int, int], Hook] | None = None,
) -> Iterator[Swarm]:
    """A coordinator, ``replicas[k]`` replicas of stages 1 and 2 (default one; replica ``r``
    of stage ``k`` with ``hooks[(k, r)]``), and the head, started in that order; the head's
    routes list them all before it is handed out; everything stopped on the way out."""
    counts = {k: (replicas or {}).get(k, 1) for k in range(1, STAGES)}
    server = start_server()
    bodies: dict[int, list[SwarmPeer]] = {}
    head = None
    try:
        for k, n in counts.items():
            bodies[k] = [
                make_peer(server.address, k, setup, (hooks or {}).get((k, r))).start()
                for r in range(n)
            ]
        head = make_peer(server.address, 0, setup).start()
        routes = head.routes
        assert routes is not None
        if not routes.wait(
            lambda: all(len(routes.endpoints(k)) == n for k, n in counts.items()), 30
        ):
            raise RuntimeError("the head's routes never listed every replica")
        yield Swarm(server, head, bodies)
    finally:
        for group in bodies.values():
            for p in group:
                p.stop()
        if head is not None:
            head.stop()
        server.stop()


def batches(tokens: torch.Tensor, steps: int, batch: int, seed: int) -> list[tuple[Any, Any]]:
    g = torch.Generator().manual_seed(seed)
    return [sample_batch(tokens, batch, SEQ, g) for _ in range(steps)]


def train_swarm(s: Driven, data: list[tuple[Any, Any]], warmup: int) -> dict[str, float]:
    """Train on ``data``; the seconds of the steps after the first ``warmup``."""
    losses = []
    t0 = time.perf_counter()
    for i, (x, y) in enumerate(data):
        if i == warmup:
            t0 = time.perf_counter()
        losses.append(s.head.train_step(x, y))
    seconds = time.perf_counter() - t0
    s.drain()
    return {"seconds": seconds, "last_loss": losses[-1]}


def train_unsplit(
    data: list[tuple[Any, Any]], warmup: int, setup: Setup
) -> tuple[nn.Sequential, float]:
    """The spec: the unsplit model, one AdamW, one backward per batch; the model and the
    seconds of the steps after the first ``warmup``."""
    model = build_sequential(setup.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=setup.lr)
    t0 = time.perf_counter()
    for i, (x, y) in enumerate(data):
        if i == warmup:
            t0 = time.perf_counter()
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return model, time.perf_counter() - t0


def held_out(model: nn.Module, tokens: torch.Tensor, windows: int) -> float:
    return evaluate(model, tokens, seq_len=SEQ, windows=windows)
