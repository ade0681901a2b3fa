"""Fixtures shared by the integration tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from diloco.server.config import ServerConfig
from diloco.server.server import DiLoCoServer


def initial_params() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(3, 4, generator=g), "b": torch.randn(4, generator=g)}


ServerFactory = Callable[..., DiLoCoServer]


@pytest.fixture
def make_server() -> Iterator[ServerFactory]:
    started: list[DiLoCoServer] = []

    def make(params: dict[str, torch.Tensor] | None = None, **config: Any) -> DiLoCoServer:
        config.setdefault("num_workers", 1)
        if config.get("allreduce"):  # the server holds no parameters in all-reduce mode
            initial = None
        else:
            initial = initial_params() if params is None else params
        server = DiLoCoServer(ServerConfig(port=0, **config), initial_params=initial)
        server.start()
        started.append(server)
        return server

    yield make
    for server in started:
        server.stop()
