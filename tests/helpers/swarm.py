"""A small swarm in one process: stage services in threads on 127.0.0.1 port 0, a driver, and
the unsplit model trained the plain way as the reference (issue 29's data plane)."""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import requests
import torch
from torch import nn

from diloco.swarm import (
    BoundaryCodec,
    BoundarySpec,
    Driver,
    Endpoint,
    StageEdges,
    StageService,
    StaticRoutes,
    split_sequential,
)
from diloco.swarm.stage_service import Hook

TOKEN = "swarm-test-token"
IN, HIDDEN, CLASSES = 8, 32, 5
LR = 0.01


def make_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(IN, HIDDEN), nn.Tanh(),
        nn.Linear(HIDDEN, HIDDEN), nn.Tanh(),
        nn.Linear(HIDDEN, HIDDEN), nn.Tanh(),
        nn.Linear(HIDDEN, CLASSES),
    )  # fmt: skip


def make_optimizer(module: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(module.parameters(), lr=LR)


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out, y)


def batches(n: int, batch: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(batch, IN, generator=g), torch.randint(0, CLASSES, (batch,), generator=g))
        for _ in range(n)
    ]


def reference(model: nn.Module, data: list[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
    """The spec: the unsplit model, one optimizer, one backward per batch."""
    opt = make_optimizer(model)
    losses = []
    for x, y in data:
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def boundaries(
    stages: list[nn.Module], codec: str = "fp32"
) -> list[tuple[BoundaryCodec, BoundaryCodec]]:
    """Each boundary's (forward, backward) codecs, its trailing shape found by a dry run."""
    out = []
    a = torch.zeros(1, IN)
    with torch.no_grad():
        for b, stage in enumerate(stages[:-1]):
            a = stage(a)
            spec = BoundarySpec(f"{b}->{b + 1}", tuple(a.shape[1:]))
            out.append((BoundaryCodec(spec, codec), BoundaryCodec(spec, codec)))
    return out


@dataclass
class Swarm:
    stages: list[nn.Module]
    services: dict[int, list[StageService]]
    routes: StaticRoutes
    driver: Driver
    extra: dict[str, object] = field(default_factory=dict)

    def endpoint(self, service: StageService) -> Endpoint:
        return Endpoint(service.address, TOKEN)


@contextmanager
def swarm(
    *,
    replicas: dict[int, int] | None = None,
    codec: str = "fp32",
    micro_batch: int = 16,
    batch: int = 16,
    max_in_flight: int = 1,
    hooks: dict[tuple[int, int], Hook] | None = None,
    timeout_floor_s: float = 1.0,
    first_timeout_s: float = 30.0,
    seed: int = 0,
    model: Callable[[int], nn.Sequential] = make_model,
    service_options: dict[int, dict[str, Any]] | None = None,
) -> Iterator[Swarm]:
    """Three stages of ``model(seed)``: the head in the driver, each remote stage ``k`` with
    ``replicas[k]`` services (deep copies of the one stage: replicas start equal)."""
    stages = split_sequential(model(seed), 3)
    edges = boundaries(stages, codec)
    counts = {1: 1, 2: 1, **(replicas or {})}
    services: dict[int, list[StageService]] = {}
    try:
        for k, n in counts.items():
            services[k] = []
            for r in range(n):
                stage = copy.deepcopy(stages[k])
                service = StageService(
                    stage,
                    make_optimizer(stage),
                    StageEdges(edges[k - 1], edges[k] if k < len(edges) else None),
                    samples_per_step=batch,
                    token=TOKEN,
                    loss_fn=loss_fn if k == len(edges) else None,
                    hook=(hooks or {}).get((k, r)),
                    **(service_options or {}).get(k, {}),
                )
                services[k].append(service.start())
        routes = StaticRoutes(
            {k: [Endpoint(s.address, TOKEN) for s in group] for k, group in services.items()}
        )
        driver = Driver(
            stages[0], make_optimizer(stages[0]), routes, edges,
            micro_batch=micro_batch, max_in_flight=max_in_flight,
            timeout_floor_s=timeout_floor_s, first_timeout_s=first_timeout_s, seed=seed,
        )  # fmt: skip
        yield Swarm(stages, services, routes, driver)
        driver.close()
    finally:
        for group in services.values():
            for service in group:
                service.stop()


def joined(s: Swarm, pick: dict[int, int] | None = None) -> dict[str, torch.Tensor]:
    """The parameters of the head and of replica ``pick[k]`` (default 0) of each stage, by the
    unsplit model's names."""
    out = dict(s.stages[0].named_parameters())
    for k, group in s.services.items():
        out.update(group[(pick or {}).get(k, 0)].stage.named_parameters())
    return {n: p.detach() for n, p in out.items()}


def post(
    service: StageService, kind: str, body: bytes, token: str | None = TOKEN, **params: object
) -> requests.Response:
    """One raw stage call, as a driver would make it."""
    headers = {"Content-Type": "application/octet-stream"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    return requests.post(
        f"{service.address}/swarm/stage/{kind}", params=params, data=body, headers=headers,
        timeout=10,
    )  # fmt: skip


class NthForward:
    """A hook for every replica of a stage that stops the ``n``-th call of ``kind`` (counted over
    all of them) before its work: it tells the test which replica holds it (``reached``) and
    waits until the test ``release``s it (after killing that replica, say)."""

    def __init__(self, n: int, kind: str = "forward") -> None:
        self.n, self.kind, self.seen, self.replica = n, kind, 0, -1
        self.reached, self.released = threading.Event(), threading.Event()
        self._lock = threading.Lock()

    def for_replica(self, r: int) -> Hook:
        def hook(kind: str, call: str) -> None:
            if kind != self.kind:
                return
            with self._lock:
                self.seen += 1
                stop = self.seen == self.n
                if stop:
                    self.replica = r
            if stop:
                self.reached.set()
                assert self.released.wait(60), "the test never released the call"

        return hook

    def release(self) -> None:
        self.released.set()
