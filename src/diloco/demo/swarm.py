"""``diloco demo --swarm``: the demo's character model as a 3-stage pipeline swarm on this
machine, beside the demo's own runs.

An in-process ``--swarm`` coordinator (3 stages, ``min_replicas`` 1) and five ``SwarmPeer``s
as threads of this process: 2 head replicas (the drivers, each on its own shard of the training
text, like the DiLoCo workers), 2 body replicas, 1 tail. Each stage's replicas run stage sync
every ``sync_every`` of their inner steps (DiLoCo among the replicas, fp32 pseudo-gradients);
activations and gradients cross the boundaries as int8. Driver ``i`` is pinned to body replica
``i``, so each body replica steps exactly once per step of its driver and reaches its round at
the end of every chunk below (a replica may serve several drivers, recomputing a forward a step
came under: the data plane's invariants in docs/design/swarm.md; unpinned, the coordinator's
routes would share the steps between the bodies unevenly, and a body's round would wait for
the other past the chunk). Both drivers share the one tail, whose calls hold nothing between
them (a loss call is forward and backward at once).

The drivers go in lockstep chunks of ``sync_every`` steps; after each chunk every replica has
finished what it was sent and its stage's round, so the stages' replicas hold the same bytes
and the swarm's model (replica 0 of each stage, joined) is evaluated on the held-out text: the
points of its curve sit at the same inner steps as the global model's.

Threads, not processes: every peer shares this process's GIL and torch pool, as processes would
share this machine's cores; the stages, the coordinator and the drivers stay inspectable here.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from diloco.demo.data import VOCAB_SIZE, Corpus, sample_batch
from diloco.demo.model import evaluate
from diloco.demo.sequential import build_sequential
from diloco.server import DiLoCoServer, ServerConfig
from diloco.swarm import Endpoint, StaticRoutes, SwarmPeer, stage_of
from diloco.wire.messages import RegisterInfo
from diloco.worker.transport.client import DiLoCoClient

STAGES = 3
LAYOUT = (0, 0, 1, 1, 2)
"""The stage of each peer: 2 heads (drivers), 2 bodies, 1 tail."""
TOKEN = "demo-swarm-token"
MICRO_BATCH = 4
"""Samples a micro-batch: a batch of 16 is 4 micro-batches, all in flight at once."""
QUIET_S = 600.0
"""Idle step period: in lockstep every replica is fed each chunk, so none needs idle steps."""


@dataclass(frozen=True)
class SwarmResult:
    curve: list[tuple[int, float]]
    """The swarm model's held-out loss at step 0 and after each chunk."""
    final_loss: float
    head_losses: list[list[float]]
    """Each driver's training loss at each of its steps."""
    sent_bytes: int
    """Boundary bytes the peers sent, all boundaries and directions."""
    rounds: list[int]
    """Each stage's stage sync rounds completed (the coordinator's count)."""
    wall_s: float

    def report(self) -> dict[str, Any]:
        """The swarm's entries in the demo's ``report.json``."""
        return {
            "swarm_eval_loss": self.final_loss,
            "swarm_curve": self.curve,
            "swarm_bytes_sent": self.sent_bytes,
            "swarm_rounds": self.rounds,
            "swarm_wall_time_s": round(self.wall_s, 1),
        }

    def summary(self) -> str:
        """The swarm's line under the demo's printed figures."""
        return (
            f"  pipeline swarm (3 stages: 2 head, 2 body, 1 tail replicas; int8 boundaries): "
            f"held-out loss {self.final_loss:.3f}   sent {self.sent_bytes / 2**20:.1f} MB between "
            f"stages   {self.wall_s:.0f} s"
        )


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.reshape(-1, VOCAB_SIZE), y.reshape(-1))


def _server(outer_lr: float) -> DiLoCoServer:
    # join_timeout 30: a stage's quorum waits for every live replica of it; heartbeat_timeout 0:
    # no eviction by the clock (the peers are threads here, their beats may queue behind work).
    config = ServerConfig(
        port=0, num_workers=1, swarm=True, stages=STAGES, min_replicas=1, token=TOKEN,
        outer_lr=outer_lr, poll_timeout=0.5, join_timeout=30.0, heartbeat_timeout=0.0,
    )  # fmt: skip
    return DiLoCoServer(config, initial_params=None).start()


@contextmanager
def _peers(server: DiLoCoServer, cfg: dict[str, Any]) -> Iterator[list[SwarmPeer]]:
    """The five peers, started at once. Every id is registered for its stage first, so each
    stage's first quorum waits for all its replicas (a replica joining a stage whose first
    quorum already formed would wait for the stage's next round)."""
    seed, seq = cfg["seed"], cfg["seq_len"]

    def build(k: int, s: int) -> nn.Module:
        return stage_of(lambda: build_sequential(seed, seq), k, s)

    ids = [f"demo-s{k}-{i}" for i, k in enumerate(LAYOUT)]
    client = DiLoCoClient(server.address, token=TOKEN)
    try:
        for peer_id, k in zip(ids, LAYOUT, strict=True):
            client.register(peer_id, info=RegisterInfo(stages=(k,)))
    finally:
        client.close()
    made = [
        SwarmPeer(
            build,
            num_stages=STAGES,
            server=server.address,
            optimizer=lambda params: torch.optim.AdamW(params, lr=cfg["lr"]),
            loss_fn=_loss,
            boundaries=(seq, 64),
            samples_per_step=cfg["batch_size"],
            micro_batch=MICRO_BATCH,
            codec="int8",
            token=TOKEN,
            stages=[k],
            worker_id=peer_id,
            sync_every=cfg["sync_every"],
            idle_step_s=QUIET_S,
            heartbeat_interval=0.0,
            max_in_flight=4,
            timeout_floor_s=5.0,
            token_dims=2,
            route_wait_s=30.0,
            seed=seed + i,
        )  # fmt: skip
        for i, (peer_id, k) in enumerate(zip(ids, LAYOUT, strict=True))
    ]
    try:
        with ThreadPoolExecutor(len(made)) as pool:
            started = [f.result(timeout=120) for f in [pool.submit(p.start) for p in made]]
        yield started
    finally:
        for p in made:
            p.stop()


def _endpoint(peer: SwarmPeer) -> Endpoint:
    assert peer.service is not None
    return Endpoint(f"http://127.0.0.1:{peer.service.port}", TOKEN)


def _drain(peers: list[SwarmPeer]) -> None:
    """Every replica has run what it was sent, its deferred step and that step's round."""
    for p in peers:
        if p.service is not None:
            p.service.drain()


def _joined(peers: list[SwarmPeer], seed: int, seq: int) -> nn.Sequential:
    """The unsplit model holding replica 0 of each stage (the stages keep its names)."""
    params: dict[str, torch.Tensor] = {}
    for k in reversed(range(STAGES)):  # replica 0 of stage k is the first peer of stage k
        module = next(p for p in peers if p.stage == k).module
        assert module is not None
        params.update({n: t.detach() for n, t in module.named_parameters()})
    model = build_sequential(seed, seq)
    model.load_state_dict(params, strict=True)
    return model


def run_swarm(
    cfg: dict[str, Any],
    corpus: Corpus,
    init_loss: float,
    on_step: Callable[[int, float], None],
) -> SwarmResult:
    """Train the swarm ``cfg["steps"]`` steps a driver (``cfg`` as the demo's runs take it;
    ``corpus`` cut in 2 shards, one per driver); ``on_step(driver, loss)`` after each step."""
    t0 = time.monotonic()
    seed, seq, h, steps = cfg["seed"], cfg["seq_len"], cfg["sync_every"], cfg["steps"]
    server = _server(cfg["outer_lr"])
    curve = [(0, init_loss)]  # every replica starts from the demo model of the seed
    losses: list[list[float]] = [[], []]
    try:
        with _peers(server, cfg) as peers:
            heads = [p for p in peers if p.stage == 0]
            bodies = [p for p in peers if p.stage == 1]
            tail = next(p for p in peers if p.stage == 2)
            for i, head in enumerate(heads):
                assert head.driver is not None
                head.driver.routes = StaticRoutes({1: [_endpoint(bodies[i])], 2: [_endpoint(tail)]})
            gens = [torch.Generator().manual_seed(seed * 1000 + i) for i in range(2)]

            def drive(i: int, first: int, last: int) -> None:
                for _ in range(first, last + 1):
                    x, y = sample_batch(corpus.shards[i], cfg["batch_size"], seq, gens[i])
                    loss = heads[i].train_step(x, y)
                    losses[i].append(loss)
                    on_step(i, loss)

            done = 0
            with ThreadPoolExecutor(2) as pool:
                while done < steps:
                    last = min(done + h, steps)
                    for f in [pool.submit(drive, i, done + 1, last) for i in range(2)]:
                        f.result()
                    done = last
                    _drain(peers)
                    curve.append((done, evaluate(_joined(peers, seed, seq), corpus.eval, seq)))
            stages = server.status()["swarm"]["stages"]
            rounds = [int(st["rounds_completed"]) for st in stages]
            sent = 0
            for p in peers:
                for row in p.stats().get("sent", {}).values():
                    sent += int(row["bytes"])
    finally:
        server.stop()
    return SwarmResult(curve, curve[-1][1], losses, sent, rounds, time.monotonic() - t0)
