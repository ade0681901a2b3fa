"""Security tests: the requests every endpoint gets, and snapshots of the server's state to
show that a refused request changed nothing."""

from __future__ import annotations

from typing import Any

from diloco.server.server import DiLoCoServer
from tests.helpers.http import (
    CLIENT,
    assert_params_equal,
    state,
)

JSON = {"Content-Type": "application/json", **CLIENT}


def snapshot(server: DiLoCoServer) -> dict[str, Any]:
    """Everything a request could change, the parameters bit for bit included."""
    st = server.status()
    out = state(server)
    out["outer_optimizer"] = st["outer_optimizer"]
    out["num_workers"] = st["num_workers"]
    out["last_save"] = st["last_save"]
    return out


def assert_same(before: dict[str, Any], server: DiLoCoServer) -> None:
    after = snapshot(server)
    assert_params_equal(before.pop("params"), after.pop("params"))
    assert after == before
