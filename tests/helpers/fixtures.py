"""Fixtures that tests of more than one lane use, imported into tests/conftest.py so that
every test module sees them: servers started in-process on 127.0.0.1 port 0, stopped after
the test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from diloco.server.config import ServerConfig
from diloco.server.server import DiLoCoServer
from tests.helpers.servers import ServerFactory, initial_params


@pytest.fixture
def make_server() -> Iterator[ServerFactory]:
    started: list[DiLoCoServer] = []

    def make(params: dict[str, torch.Tensor] | None = None, **config: Any) -> DiLoCoServer:
        config.setdefault("num_workers", 1)
        if config.get("allreduce") or config.get("swarm"):  # the server holds no parameters
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


@pytest.fixture
def server_of() -> Iterator[Callable[[int], DiLoCoServer]]:
    started: list[DiLoCoServer] = []

    def make(num_workers: int) -> DiLoCoServer:
        srv = DiLoCoServer(ServerConfig(port=0, num_workers=num_workers, outer_momentum=0.0))
        started.append(srv.start())
        return srv

    yield make
    for srv in started:
        srv.stop()
