"""``diloco status`` of an all-reduce server reads what its ``/status`` has: the quorums' round,
the open quorum's members, the model's size from the workers' table, exclusions. A real server
in all-reduce mode on loopback, driven over HTTP (no tensors)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import requests

from diloco.cli.status import render_status
from diloco.server.observe.status import Status
from diloco.server.server import DiLoCoServer
from tests.helpers.http import post_json
from tests.helpers.servers import ServerFactory

TABLE = [["b", [4]], ["w", [3, 4]]]  # 16 parameters
FAST = {"poll_timeout": 2.0, "join_timeout": 0.0, "heartbeat_timeout": 0.0}


def register(server: DiLoCoServer, worker_id: str) -> None:
    resp = post_json(server, "/register", {"worker_id": worker_id, "info": {"params": TABLE}})
    assert resp.status_code == 200, resp.text


def ask(server: DiLoCoServer, worker_id: str, round_: int, hash_: str) -> requests.Response:
    body = {"worker_id": worker_id, "round": round_, "hash": hash_, "has_state": True}
    return post_json(server, "/quorum", body)


def both_ask(server: DiLoCoServer, round_: int, hash_: str) -> list[dict[str, Any]]:
    # Each ask long-polls until the quorum forms: two at once, so each is the other's event.
    with ThreadPoolExecutor(2) as pool:
        replies = list(pool.map(lambda w: ask(server, w, round_, hash_), ("w-a", "w-b")))
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
    return [r.json() for r in replies]


def shown(server: DiLoCoServer) -> str:
    return render_status(Status.from_json(server.status()))


def test_status_shows_the_quorums_not_a_barrier(make_server: ServerFactory) -> None:
    server = make_server(allreduce=True, num_workers=2, **FAST)
    before = shown(server)
    assert "waiting for workers" in before and "model not known yet" in before
    assert "0 params" not in before
    register(server, "w-a")
    register(server, "w-b")
    qa, _ = both_ask(server, 0, "h0")
    text = shown(server)
    assert text.splitlines()[0].startswith("mode allreduce  round 0  quorum ")
    assert f"quorum {qa['quorum_id']} of 2 open" in text
    assert "model 16 params (the workers' table)" in text
    assert "quorums: completed 0, discarded 0  members w-a, w-b" in text
    assert "waiting for workers" not in text and "outer lr" not in text
    for worker in ("w-a", "w-b"):  # one member's checks left w-b out of the average
        reply = post_json(
            server,
            "/quorum/outcome",
            {"worker_id": worker, "quorum_id": qa["quorum_id"], "ok": True, "round": 1,
             "hash": "h1", "excluded": ["w-b"]},
        )  # fmt: skip
        assert reply.status_code == 200, reply.text
    text = shown(server)
    assert text.splitlines()[0].startswith("mode allreduce  round 1  between quorums")
    assert "quorums: completed 1, discarded 0  members -" in text
    assert server.status()["excluded_last"] == ["w-b"]
    assert "left out of the last checked average: w-b" in text
    assert "rounds excluded: w-b 1 (1 in a row)" in text
