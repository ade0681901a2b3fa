"""``diloco swarm-peer``: join a pipeline swarm (``diloco server --swarm``) as a ``SwarmPeer``.

The peer registers, is assigned a stage, builds only that stage with ``--model
pkg.module:build_stage`` (``build_stage(k, S) -> nn.Module``) and either serves it until
SIGTERM (a body or the tail) or, assigned the head, drives ``--steps`` batches from ``--data
pkg.module:batches`` (a function returning an iterator of ``(x, y)``) and leaves. Exit status
0 when it left cleanly. The inner optimizer is AdamW at ``--lr``; the tail's loss is
``--loss`` (default: cross entropy). ``--sync-every N`` turns on stage sync (``SwarmPeer``'s
``sync_every``: DiLoCo among the stage's replicas, fp32 pseudo-gradients).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import logging
from typing import Any

import torch
from torch import nn

from diloco.cli import flags
from diloco.swarm import SwarmPeer

log = logging.getLogger(__name__)


def _flag(default: Any, help: str, **meta: Any) -> Any:
    return dataclasses.field(default=default, metadata={"help": help, **meta})


@dataclasses.dataclass(frozen=True)
class PeerFlags:
    """The command's settings (each field one flag)."""

    model: str | None = _flag(
        None, "the stage builder, pkg.module:build_stage", metavar="MODULE:FN"
    )
    stages: int = _flag(0, "the swarm's number of stages (the server's --stages)")
    boundary: str | None = _flag(
        None, "each boundary's shape past the batch: '32' for all, '16,32' (seq, hidden), "
        "or one per boundary separated by ';'"
    )  # fmt: skip
    server: str = _flag("localhost", "the coordinator, host[:port] or a URL")
    token: str | None = _flag(None, "the run's token", env="DILOCO_TOKEN")
    fits: str | None = _flag(None, "the stages that fit this peer, '1,2' (absent: any)")
    batch: int = _flag(16, "samples a step (the head's batch; a stage steps on that many)")
    micro_batch: int = _flag(0, "samples a micro-batch (default: the whole batch)")
    codec: str = _flag("int8", "activations' codec", choices=("fp32", "bf16", "int8", "int4"))
    lr: float = _flag(1e-3, "the stage's AdamW learning rate")
    host: str = _flag("127.0.0.1", "the address the stage service binds (and announces)")
    announce: str | None = _flag(
        None, "the address drivers dial, when it is not --host (required with --host 0.0.0.0)"
    )
    port: int = _flag(0, "the stage service's port (0: any free one)")
    heartbeat_interval: float = _flag(5.0, "seconds between heartbeats")
    data: str | None = _flag(
        None, "a head's data, pkg.module:batches (returns an iterator of (x, y))"
    )
    steps: int = _flag(0, "steps a head trains, then leaves")
    loss: str | None = _flag(None, "the tail's loss, pkg.module:fn (default: cross entropy)")
    tls_ca: str | None = _flag(
        None, "a PEM bundle that verifies the coordinator's and the stage services' certificates"
    )
    tls_cert: str | None = _flag(None, "PEM certificate chain: serve this peer's stage over HTTPS")
    tls_key: str | None = _flag(None, "PEM private key of --tls-cert")
    sync_every: int | None = _flag(
        None, "stage sync: DiLoCo among the stage's replicas every N inner steps (absent: none)",
        metavar="N",
    )  # fmt: skip
    idle_step_s: float = _flag(
        10.0, "stage sync: a serving replica not called for this long takes an idle step"
    )


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "swarm-peer",
        help="join a pipeline swarm: serve a stage, or drive it from the head",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    flags.add_flags(p, PeerFlags)
    p.set_defaults(func=run)


def load(spec: str, what: str) -> Any:
    """``pkg.module:name``, imported."""
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"{what}: expected pkg.module:name, got {spec!r}")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"{what}: cannot load {spec!r}: {exc}") from None


def shapes(text: str, num_stages: int) -> list[tuple[int, ...]]:
    try:
        parts = [tuple(int(d) for d in part.split(",")) for part in text.split(";")]
    except ValueError:
        raise ValueError(
            f"--boundary: expected integers like '32' or '16,32', got {text!r}"
        ) from None
    if len(parts) == 1:
        return parts * (num_stages - 1)
    return parts


def run(args: argparse.Namespace) -> int:
    s = PeerFlags(**flags.values(PeerFlags, args))
    if not s.model or s.stages < 2 or not s.boundary:
        raise ValueError("--model, --stages (at least 2) and --boundary are required")
    build = load(s.model, "--model")
    loss_fn = load(s.loss, "--loss") if s.loss else nn.functional.cross_entropy
    fits = [int(k) for k in s.fits.split(",")] if s.fits else None
    peer = SwarmPeer(
        build, num_stages=s.stages, server=s.server,
        optimizer=lambda params: torch.optim.AdamW(params, lr=s.lr), loss_fn=loss_fn,
        boundaries=shapes(s.boundary, s.stages), samples_per_step=s.batch,
        micro_batch=s.micro_batch or s.batch, codec=s.codec, token=s.token, stages=fits,
        host=s.host, port=s.port, announce=s.announce, heartbeat_interval=s.heartbeat_interval,
        sync_every=s.sync_every, idle_step_s=s.idle_step_s, tls_ca=s.tls_ca,
        tls_cert=s.tls_cert, tls_key=s.tls_key,
    )  # fmt: skip
    peer.start()
    try:
        if peer.stage != 0:
            log.info("serving stage %d until SIGTERM", peer.stage)
            peer.serve()
            return 0
        if not s.data or s.steps < 1:
            raise ValueError("this peer drives the swarm (stage 0): give --data and --steps")
        batches = iter(load(s.data, "--data")())
        for step in range(s.steps):
            x, y = next(batches)
            log.info("step %d loss %.4f", step, peer.train_step(x, y))
        return 0
    finally:
        peer.stop()
