"""/status of a running server, key for key against the status dataclasses
(server/observe/status.py): a field renamed on one side fails here, and the JSON parses back to
itself."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import requests
import torch

from diloco.server.observe.status import Status
from diloco.server.server import DiLoCoServer
from tests.helpers.http import (
    EXACT,
    TIMEOUT,
    accept,
    body,
    register,
    url,
    wait_round,
)
from tests.helpers.servers import ServerFactory
from tests.helpers.status import assert_keys


def http_status(server: DiLoCoServer) -> dict[str, Any]:
    return requests.get(url(server, "/status"), timeout=TIMEOUT).json()


def filled(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((3, 4), value), "b": torch.full((4,), value)}


def test_sync_status_keys_are_the_fields(make_server: ServerFactory, tmp_path: Path) -> None:
    server = make_server(num_workers=2, save_dir=str(tmp_path), **EXACT)
    register(server, "a")
    register(server, "b")
    accept(server, body("a", 0, "a-0", filled(3e38)))  # their sum overflows: refused
    accept(server, body("b", 0, "b-0", filled(3e38)))
    wait_round(server, 1)
    assert server.save_state() is not None
    st = http_status(server)
    assert st["last_refusal"] and st["last_save"] and st["update_log"] and st["workers"]
    assert_keys(Status, st)
    assert Status.from_json(st).to_json() == st


def test_async_status_keys_are_the_fields(make_server: ServerFactory) -> None:
    server = make_server(num_workers=1, mode="async", delayed_nesterov=True, dn_buffer_size=2)
    register(server, "a")
    accept(server, body("a", 0, "a-0", seed=1))
    st = http_status(server)
    assert st["delayed_nesterov"] and st["update_log"][-1]["staleness"] == 0
    assert_keys(Status, st)
    assert Status.from_json(st).to_json() == st
