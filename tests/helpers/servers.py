"""The initial parameters of a test server, the type of the fixture that starts servers, and
what a server publishes."""

from __future__ import annotations

from collections.abc import Callable

import torch

from diloco.server.server import DiLoCoServer
from diloco.worker.transport.client import DiLoCoClient


def initial_params() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(3, 4, generator=g), "b": torch.randn(4, generator=g)}


ServerFactory = Callable[..., DiLoCoServer]


def published(address: str) -> tuple[int, dict[str, torch.Tensor]]:
    """What ``GET /global_params`` serves now (the bytes every replica must hold)."""
    client = DiLoCoClient(address, retries=1, backoff=0.01, connect_timeout=2, read_timeout=10)
    try:
        return client.get_global_params()
    finally:
        client.close()
