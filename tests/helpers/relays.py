"""Regions of workers behind relay servers under one upstream server, all in this process: the
relay tests' topology (tests/integration/test_relay*.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from diloco import DiLoCoServer, DiLoCoWorker, ServerConfig
from diloco.server.relay.front import RelayCoordinator
from diloco.server.relay.upstream import Upstream
from tests.helpers.faultproxy import FaultProxy
from tests.helpers.reference import batches, make_inner, train_step
from tests.helpers.threads import in_threads


def upstream_of(relay: DiLoCoServer) -> Upstream:
    """A relay's link to its upstream (``server/relay/upstream.py``)."""
    front = relay.front
    assert isinstance(front, RelayCoordinator)
    return front.upstream


@dataclass
class Topology:
    upstream: DiLoCoServer
    relays: list[DiLoCoServer]
    #: One proxy per relay between it and the upstream: the bytes across each upstream link.
    links: list[FaultProxy] = field(default_factory=list)


@contextmanager
def regions(
    sizes: Sequence[int], upstream: dict[str, Any] | None = None, **relay_kw: Any
) -> Iterator[Topology]:
    """An upstream server expecting one worker per region, and a relay per region expecting
    ``sizes[k]`` workers, each relay reaching the upstream through a counting proxy. Relays stop
    first (their last upload answered), then the upstream."""
    with ExitStack() as stack:
        up = stack.enter_context(
            DiLoCoServer(ServerConfig(port=0, num_workers=len(sizes), **(upstream or {})))
        )
        links = [FaultProxy(up.port) for _ in sizes]
        for link in links:
            stack.callback(link.close)
        relays = [
            stack.enter_context(
                DiLoCoServer(ServerConfig(port=0, num_workers=n, upstream=link.address, **relay_kw))
            )
            for n, link in zip(sizes, links, strict=True)
        ]
        yield Topology(up, relays, links)


def region_of(sizes: Sequence[int], worker: int) -> int:
    bounds = [sum(sizes[: k + 1]) for k in range(len(sizes))]
    return next(k for k, b in enumerate(bounds) if worker < b)


def train_regions(
    top: Topology,
    sizes: Sequence[int],
    make_model: Callable[[], torch.nn.Module],
    steps: int,
    sync_every: int,
) -> list[dict[str, float]]:
    """Worker ``i`` (of region ``region_of(i)``) trains ``steps`` steps on ``batches(i)`` in a
    thread; each worker's metrics."""
    total = sum(sizes)
    models = [make_model() for _ in range(total)]  # here: torch.manual_seed is process-global

    def work(i: int) -> dict[str, float]:
        model = models[i]
        inner = make_inner(model)
        relay = top.relays[region_of(sizes, i)]
        with DiLoCoWorker(
            model,
            inner,
            relay.address,
            sync_every=sync_every,
            bf16_comm=False,
            worker_id=f"w{i}",
            heartbeat_interval=0,
        ) as worker:
            for batch in batches(i, steps):
                train_step(model, inner, batch)
        return worker.sync_metrics

    return in_threads(total, work, timeout=120)
