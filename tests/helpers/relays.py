"""Regions of workers behind relay servers under one upstream server, all in this process (the
relay tests' topology), and the one-worker ledger the relay fault tests check
(tests/integration/test_relay*.py, tests/processes/test_relay_kill.py)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from diloco import DiLoCoClient, DiLoCoServer, DiLoCoWorker, ServerConfig
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


G = 0.125  # every element moves by -G per inner step


class Ledger:
    """One worker whose every inner step moves every element by exactly ``-G`` (SGD, lr 1, a
    constant gradient), training in a thread against ``address``. Behind a relay that forwards
    its pseudo-gradient to an upstream stepping plain SGD (lr 1, no momentum), the upstream's
    parameters must end at ``init - (steps - dropped) * G``: a step counted twice, or lost, shows
    up as a multiple of ``G`` (as ``tests/helpers/crash_scenario.py``'s ledger for one server)."""

    def __init__(self, address: str, steps: int, sync_every: int) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Linear(64, 32)
        self.init = {n: p.detach().clone() for n, p in self.model.named_parameters()}
        self.steps = steps
        opt = torch.optim.SGD(self.model.parameters(), lr=1.0)
        client = DiLoCoClient(address, retries=40, backoff=0.05, max_backoff=0.5, read_timeout=30)
        self.worker = DiLoCoWorker(
            self.model,
            opt,
            address,
            sync_every=sync_every,
            bf16_comm=False,
            worker_id="w",
            heartbeat_interval=0,
            client=client,
        )
        self.errors: list[BaseException] = []

        def train() -> None:
            try:
                with self.worker:
                    for _ in range(steps):
                        for p in self.model.parameters():
                            p.grad = torch.full_like(p, G)
                        opt.step()
                        opt.zero_grad()
                    self.worker.force_sync()  # every step handed in and its round adopted
            except BaseException as exc:  # noqa: BLE001 - reported by ``finish``
                self.errors.append(exc)

        self.thread = threading.Thread(target=train, daemon=True)
        self.thread.start()

    def finish(self, timeout: float) -> None:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the worker hung"
        assert not self.errors, self.errors

    @property
    def dropped(self) -> int:
        return int(self.worker.sync_metrics["dropped_steps"])

    def check(self, upstream: dict[str, torch.Tensor], served: dict[str, torch.Tensor]) -> None:
        """Every step counted upstream once, or counted as dropped; the relay serves the
        upstream's parameters and the worker holds them."""
        for name, start in self.init.items():
            expected = start - (self.steps - self.dropped) * G
            torch.testing.assert_close(upstream[name], expected, rtol=0, atol=1e-5)
            assert torch.equal(served[name], upstream[name])
            assert torch.equal(self.model.state_dict()[name], upstream[name])
