"""Swarm peers joined through a real in-process coordinator (``diloco server --swarm``): the
data plane's small model (``swarm.py``) cut into 3 stages, each peer building only its own."""

from __future__ import annotations

import copy
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import requests
import torch
from torch import nn

from diloco import DiLoCoClient, DiLoCoWorker, ServerConfig
from diloco.server.server import DiLoCoServer
from diloco.swarm import Endpoint, SwarmPeer, stage_of
from diloco.wire.messages import RegisterInfo
from tests.helpers.swarm import HIDDEN, LR, loss_fn, make_model
from tests.helpers.threads import in_threads

STAGES = 3
BATCH = 16
FAST = {"poll_timeout": 0.5, "join_timeout": 0.0, "heartbeat_timeout": 0.0}
"""A coordinator whose long polls end soon (peers stop promptly) and that evicts no one by the
clock (the tests decide who leaves)."""


_BUILT: dict[tuple[int, int], nn.Module] = {}
_BUILDING = threading.Lock()


def build_stage(k: int, num_stages: int) -> nn.Module:
    """Stage ``k`` of ``make_model(0)``, built once (torch's global generator seeds it, and
    peers started in threads must not draw from it while another thread's code may), then
    copied."""
    with _BUILDING:
        if (k, num_stages) not in _BUILT:
            _BUILT[(k, num_stages)] = stage_of(make_model, k, num_stages)
        return copy.deepcopy(_BUILT[(k, num_stages)])


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR)


def make_peer(
    server: DiLoCoServer,
    fits: int,
    build: Any = build_stage,
    kind: type[SwarmPeer] = SwarmPeer,
    **options: Any,
) -> SwarmPeer:
    """A peer (of class ``kind``) that fits only stage ``fits`` (so the test knows who is
    who), fp32 boundaries, one micro-batch a step unless ``options`` say otherwise, no
    heartbeat thread (the tests call ``beat``)."""
    settings: dict[str, Any] = {
        "num_stages": STAGES,
        "server": server.url,  # its scheme too: https for a TLS coordinator
        "optimizer": adamw,
        "loss_fn": loss_fn,
        "boundaries": (HIDDEN,),
        "samples_per_step": BATCH,
        "micro_batch": BATCH,
        "codec": "fp32",
        "stages": [fits],
        "heartbeat_interval": 0.0,
        "token": server.config.token,
        **options,
    }
    return kind(build, **settings)


@contextmanager
def peers(server: DiLoCoServer, *fits: int, **options: Any) -> Iterator[list[SwarmPeer]]:
    """Peers started in order (one per entry of ``fits``), all stopped on the way out."""
    started: list[SwarmPeer] = []
    try:
        for k in fits:
            started.append(make_peer(server, k, **options).start())
        yield started
    finally:
        for p in started:
            p.stop()


def route_table(server: DiLoCoServer) -> dict[int, list[str]]:
    """The coordinator's table now: peer ids per stage."""
    headers = {"Authorization": f"Bearer {server.config.token}"} if server.config.token else {}
    got = requests.get(f"http://{server.address}/swarm/routes", headers=headers, timeout=10)
    got.raise_for_status()
    return {s["stage"]: [r["peer_id"] for r in s["replicas"]] for s in got.json()["stages"]}


def leave_out(head: SwarmPeer, idle: SwarmPeer) -> None:
    """The head's driver calls the body replica ``idle`` no more: reported suspect once the
    head's table lists both body replicas (a later table listing it would bring it back)."""
    routes = head.routes
    assert routes is not None and idle.service is not None
    assert routes.wait(lambda: len(routes.endpoints(1)) == 2 and bool(routes.endpoints(2)), 30)
    routes.suspect(Endpoint(f"http://127.0.0.1:{idle.service.port}", head.token), "left out")


def params_of(*modules: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters of ``modules`` by the unsplit model's names."""
    return {n: p.detach().clone() for m in modules for n, p in m.named_parameters()}


def unsplit_diloco(
    data: list[tuple[torch.Tensor, torch.Tensor]], every: int
) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The spec of stage sync: the UNSPLIT model trained by one single-process ``DiLoCoWorker``
    in all-reduce mode (a real in-process server), fp32, syncing every ``every`` steps with the
    server's default outer step. Its final parameters and its losses."""
    model = make_model(0)
    opt = adamw(model.parameters())
    losses = []
    with (
        DiLoCoServer(ServerConfig(port=0, num_workers=1, allreduce=True)) as srv,
        DiLoCoWorker(
            model, opt, srv.address, sync_every=every, bf16_comm=False, heartbeat_interval=0.0
        ) as worker,
    ):
        for x, y in data:
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        assert worker.sync_metrics["rounds"] == len(data) // every
    return params_of(model), losses


class AfterRounds:
    """Records each replica's stage parameters right after each of its stage's rounds: an
    optimizer post-step hook registered after the peer's ``DiLoCoWorker`` hook (hooks run in
    order), so it sees the round's result when the worker's ``local_step`` is back to 0."""

    def __init__(self) -> None:
        self.seen: dict[tuple[int, int], list[dict[str, torch.Tensor]]] = {}
        self._lock = threading.Lock()

    def watch(self, peer: SwarmPeer) -> None:
        worker, module = peer.worker, peer.module
        assert worker is not None and module is not None and peer.stage is not None
        opt = peer.driver.head_optimizer if peer.driver is not None else None
        if opt is None:
            assert peer.service is not None
            opt = peer.service.optimizer
        stage = peer.stage

        def hook(*_: Any) -> None:
            if worker.local_step == 0:
                key = (stage, int(worker.sync_metrics["round"]))
                with self._lock:
                    self.seen.setdefault(key, []).append(params_of(module))

        opt.register_step_post_hook(hook)


@contextmanager
def together(
    server: DiLoCoServer, *fits: int, options: list[dict[str, Any]] | None = None, **common: Any
) -> Iterator[list[SwarmPeer]]:
    """Peers (one per entry of ``fits``) started at once, in threads: with stage sync, a stage's
    first quorum (every replica's join) waits for every replica registered for it, so their ids
    are registered first, each for its stage (``RegisterInfo.stages``); each peer then registers
    again under its id and keeps that stage. Without this, a replica joining a stage whose first
    quorum already formed waits for its stage's next round."""
    ids = [f"p{i}s{k}" for i, k in enumerate(fits)]
    for k in set(fits):
        build_stage(k, STAGES)  # here, before any thread runs
    client = DiLoCoClient(server.address, token=server.config.token)
    try:
        for peer_id, k in zip(ids, fits, strict=True):
            assert client.register(peer_id, info=RegisterInfo(stages=(k,)))["stage"] == k
    finally:
        client.close()
    made = [
        make_peer(server, k, worker_id=peer_id, **{**common, **(options or [{}] * len(fits))[i]})
        for i, (peer_id, k) in enumerate(zip(ids, fits, strict=True))
    ]
    try:
        yield in_threads(len(made), lambda i: made[i].start(), timeout=60)
    finally:
        for p in made:
            p.stop()
