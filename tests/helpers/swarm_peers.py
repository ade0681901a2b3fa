"""Swarm peers joined through a real in-process coordinator (``diloco server --swarm``): the
data plane's small model (``swarm.py``) cut into 3 stages, each peer building only its own."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import requests
import torch
from torch import nn

from diloco.server.server import DiLoCoServer
from diloco.swarm import SwarmPeer, stage_of
from tests.helpers.swarm import HIDDEN, LR, loss_fn, make_model

STAGES = 3
BATCH = 16
FAST = {"poll_timeout": 0.5, "join_timeout": 0.0, "heartbeat_timeout": 0.0}
"""A coordinator whose long polls end soon (peers stop promptly) and that evicts no one by the
clock (the tests decide who leaves)."""


def build_stage(k: int, num_stages: int) -> nn.Module:
    return stage_of(make_model, k, num_stages)


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR)


def make_peer(
    server: DiLoCoServer, fits: int, build: Any = build_stage, **options: Any
) -> SwarmPeer:
    """A peer that fits only stage ``fits`` (so the test knows who is who), fp32 boundaries,
    one micro-batch a step unless ``options`` say otherwise, no heartbeat thread (the tests
    call ``beat``)."""
    settings: dict[str, Any] = {
        "num_stages": STAGES,
        "server": server.address,
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
    return SwarmPeer(build, **settings)


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


def params_of(*modules: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters of ``modules`` by the unsplit model's names."""
    return {n: p.detach().clone() for m in modules for n, p in m.named_parameters()}
