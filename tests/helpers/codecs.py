"""Codec uploads: the shapes, pseudo-gradients and models the codec tests share, and waiting
for the server to show a state."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from diloco import DiLoCoWorker
from diloco.server.server import DiLoCoServer
from tests.helpers.http import (
    TIMEOUT,
)

SHAPES = {"w": (64, 48), "b": (48,), "e": (5000,)}  # a matrix for low rank, odd-length vectors


def model() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}


def grads(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + seed)
    return {n: torch.randn(s, generator=g) * 1e-2 for n, s in SHAPES.items()}


def wait_status(server: DiLoCoServer, done: Callable[[dict[str, Any]], bool]) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not done(st := server.status()):
        assert time.monotonic() < deadline, st
        time.sleep(0.005)


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(40, 30), torch.nn.Linear(30, 5))


def worker(**kw: object) -> DiLoCoWorker:
    model = make_model()
    return DiLoCoWorker(model, torch.optim.SGD(model.parameters(), lr=0.1), "127.0.0.1:1", **kw)  # type: ignore[arg-type]
