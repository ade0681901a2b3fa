"""The demo swarm with its stage replicas as spawned processes: the coordinator and the head
stay in this process, stages 1 and 2 each serve from a child of their own (one torch thread
each). Against the threads of ``demo_swarm.swarm`` it shows what the one process's GIL costs.

A child joins through the coordinator like any peer, serves until the parent sets its stop
event, waits for its compute thread to finish what it was sent, writes its stage's parameters
(safetensors, the unsplit model's names) where the parent reads them, then leaves.
"""

from __future__ import annotations

import multiprocessing as mp
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from benchmarks.swarm.demo_swarm import STAGES, Setup, make_peer, start_server
from diloco import DiLoCoServer
from diloco.demo.sequential import build_sequential
from diloco.swarm import SwarmPeer

JOIN_S = 120.0
"""Spawned children import torch and diloco first: seconds on a busy 2-core machine."""


def _serve(address: str, fits: int, setup: Setup, stop: Any, out: str) -> None:
    """A child: one stage replica until ``stop`` is set; its parameters then go to ``out``."""
    import logging

    import torch
    from safetensors.torch import save_file

    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    peer = make_peer(address, fits, setup).start()
    try:
        stop.wait()
        assert peer.service is not None and peer.module is not None
        peer.service.drain()
        save_file({n: p.detach().contiguous() for n, p in peer.module.named_parameters()}, out)
    finally:
        peer.stop()


@dataclass
class ProcessSwarm:
    """What ``train_swarm`` and ``throughput`` use of a swarm, with remote stages."""

    server: DiLoCoServer
    head: SwarmPeer
    stop: Any
    children: list[Any]
    files: list[Path]

    def drain(self) -> None:
        """The children drain themselves before they write their parameters."""

    def sent(self) -> dict[str, dict[str, float]]:
        """Not counted: the children's counts stay in the children."""
        return {}

    def joined(self, seed: int) -> nn.Sequential:
        """Stop the children (each drains and writes its stage) and join the stages."""
        from safetensors.torch import load_file

        self.stop.set()
        for child in self.children:
            child.join(JOIN_S)
        params = {n: p.detach() for n, p in self.head.module.named_parameters()}  # type: ignore[union-attr]
        for f in self.files:
            params.update(load_file(str(f)))
        model = build_sequential(seed)
        model.load_state_dict(params, strict=True)
        return model


@contextmanager
def process_swarm(setup: Setup) -> Iterator[ProcessSwarm]:
    """A coordinator here, one child per remote stage, the head here once its routes list
    both; children stopped (and, if need be, killed) on the way out."""
    ctx = mp.get_context("spawn")
    server = start_server()
    stop = ctx.Event()
    children: list[Any] = []
    head = None
    with tempfile.TemporaryDirectory() as tmp:
        files = [Path(tmp) / f"stage-{k}.safetensors" for k in range(1, STAGES)]
        try:
            for k, f in zip(range(1, STAGES), files, strict=True):
                child = ctx.Process(target=_serve, args=(server.address, k, setup, stop, str(f)))
                child.start()
                children.append(child)
            head = make_peer(server.address, 0, setup).start()
            routes = head.routes
            assert routes is not None
            if not routes.wait_for(range(1, STAGES), JOIN_S):
                raise RuntimeError("the stage processes never joined the route table")
            yield ProcessSwarm(server, head, stop, children, files)
        finally:
            stop.set()
            for child in children:
                child.join(JOIN_S)
                if child.is_alive():
                    child.kill()
                    child.join()
            if head is not None:
                head.stop()
            server.stop()
