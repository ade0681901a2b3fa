"""Swarm mode's coordinator over HTTP (``diloco server --swarm --stages S``): stages assigned at
registration, ``/swarm/ready`` checked against the stage's table, the route table's long poll,
suspect reports, evictions, ``/status`` and ``/metrics``, the token and malformed bodies. A real
server on loopback; no tensors (the stage services are part A's)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import requests

from diloco.cli.status import render_status
from diloco.server.config import ServerConfig
from diloco.server.observe.status import Status
from diloco.server.server import DiLoCoServer
from diloco.server.swarm.swarm_front import SwarmFront
from tests.helpers.clock import FakeClock
from tests.helpers.http import AUTH, CLIENT, TIMEOUT, TOKEN, assert_error, post_json, url
from tests.helpers.servers import ServerFactory

FAST = {"poll_timeout": 0.5, "join_timeout": 0.0, "heartbeat_timeout": 0.0}
TABLES = [
    [["0.weight", [16, 8]], ["0.bias", [16]]],
    [["2.weight", [16, 16]], ["2.bias", [16]]],
    [["4.weight", [4, 16]], ["4.bias", [4]]],
]


def register(server: DiLoCoServer, peer: str, fits: list[int] | None = None, **hdr: str) -> Any:
    info = {} if fits is None else {"stages": fits}
    return post_json(server, "/register", {"worker_id": peer, "info": info}, hdr)


def ready(server: DiLoCoServer, peer: str, stage: int, table: Any = None, **hdr: str) -> Any:
    body = {
        "worker_id": peer,
        "stage": stage,
        "params": TABLES[stage] if table is None else table,
        "address": f"http://10.0.0.{stage + 1}:87{len(peer):02d}",
    }
    return post_json(server, "/swarm/ready", body, hdr)


def routes(server: DiLoCoServer, version: int = -1, **hdr: str) -> requests.Response:
    return requests.get(
        url(server, f"/swarm/routes?version={version}"), headers=hdr, timeout=TIMEOUT
    )


def table(server: DiLoCoServer) -> dict[int, list[str]]:
    got = routes(server).json()
    return {s["stage"]: [r["peer_id"] for r in s["replicas"]] for s in got["stages"]}


def beat(server: DiLoCoServer, peer: str, **swarm: Any) -> requests.Response:
    body: dict[str, Any] = {"worker_id": peer}
    if swarm:
        body["swarm"] = swarm
    return post_json(server, "/heartbeat", body)


def full(server: DiLoCoServer, peers: tuple[str, ...]) -> dict[str, int]:
    stages = {}
    for peer in peers:
        resp = register(server, peer)
        assert resp.status_code == 200, resp.text
        stages[peer] = resp.json()["stage"]
        assert ready(server, peer, stages[peer]).status_code == 200
    return stages


def test_registration_assigns_stages_in_order_and_says_so(make_server: ServerFactory) -> None:
    server = make_server(swarm=True, stages=3, min_replicas=2, **FAST)
    replies = [register(server, f"p{i}").json() for i in range(6)]
    assert [r["stage"] for r in replies] == [0, 1, 2, 0, 1, 2]
    assert {(r["mode"], r["num_stages"], r["has_params"]) for r in replies} == {("swarm", 3, False)}
    # Past min_replicas, a peer that fits stage 2 only goes there; none fitting is a 400.
    assert register(server, "p6", [2]).json()["stage"] == 2
    assert_error(register(server, "p7", [3, 9]), 400, "no_fitting_stage")
    assert "p7" not in {w["worker_id"] for w in server.status()["workers"]}


def test_a_replica_with_another_table_or_stage_is_refused_and_changes_nothing(
    make_server: ServerFactory,
) -> None:
    server = make_server(swarm=True, stages=3, min_replicas=1, **FAST)
    full(server, ("a", "b", "c"))
    assert register(server, "d", [1]).json()["stage"] == 1
    before = (routes(server).json(), server.status()["swarm"])
    wrong = [["2.weight", [16, 12]], ["2.bias", [16]]]
    reply = assert_error(ready(server, "d", 1, wrong), 409, "params_mismatch")
    assert "2.weight has shape [16, 12], the run's is [16, 16]" in reply["detail"]
    assert "stage 1" in reply["detail"]
    assert_error(ready(server, "d", 2), 409, "wrong_stage")
    assert_error(ready(server, "nobody", 1), 410, "unknown_worker")
    assert (routes(server).json(), server.status()["swarm"]) == before
    assert ready(server, "d", 1).status_code == 200
    assert table(server) == {0: ["a"], 1: ["b", "d"], 2: ["c"]}


def test_the_route_table_long_poll_answers_on_change_and_at_its_bound(
    make_server: ServerFactory,
) -> None:
    server = make_server(swarm=True, stages=2, min_replicas=1, **FAST)
    full(server, ("a", "b"))
    now = routes(server).json()
    assert now["num_stages"] == 2 and now["stages"][1]["replicas"][0]["address"].startswith("http")
    # Nothing changes: the same version back after poll_timeout, bounded.
    start = time.monotonic()
    same = routes(server, now["version"]).json()
    assert same["version"] == now["version"] and time.monotonic() - start < 0.5 + 1.0
    # A change (a replica joins) answers the poll: whether it was parked before the change or
    # asked after it, it gets the newer version.
    got: list[dict[str, Any]] = []
    poll = threading.Thread(target=lambda: got.append(routes(server, now["version"]).json()))
    poll.start()
    assert register(server, "c").json()["stage"] == 0
    assert ready(server, "c", 0).status_code == 200
    poll.join(TIMEOUT)
    assert got and got[0]["version"] > now["version"]
    assert [r["peer_id"] for r in got[0]["stages"][0]["replicas"]] == ["a", "c"]


def test_a_suspect_is_left_out_until_it_heartbeats_again(make_server: ServerFactory) -> None:
    server = make_server(swarm=True, stages=2, min_replicas=2, **FAST)
    full(server, ("a", "b", "c", "d"))  # a, c: stage 0; b, d: stage 1
    report = {"worker_id": "a", "suspect": "d", "stage": 1, "reason": "connection reset"}
    assert post_json(server, "/swarm/suspect", report).status_code == 200
    assert table(server) == {0: ["a", "c"], 1: ["b"]}
    st = server.status()["swarm"]
    assert st["suspects"][0]["peer_id"] == "d" and st["suspects"][0]["reason"] == "connection reset"
    assert beat(server, "d").status_code == 200
    assert table(server) == {0: ["a", "c"], 1: ["b", "d"]}
    assert server.status()["swarm"]["suspects"] == []
    wrong = {**report, "stage": 0}
    assert_error(post_json(server, "/swarm/suspect", wrong), 409, "wrong_stage")
    stranger = {**report, "worker_id": "x"}
    assert_error(post_json(server, "/swarm/suspect", stranger), 410, "unknown_worker")
    assert table(server) == {0: ["a", "c"], 1: ["b", "d"]}


@pytest.fixture
def faked() -> Any:
    clock = FakeClock()
    config = ServerConfig(port=0, swarm=True, stages=2, min_replicas=1, heartbeat_timeout=30.0)
    server = DiLoCoServer(config)
    server.front = SwarmFront(config, clock)  # before start(): the app is built on the fake clock
    server.start()
    yield server, clock
    server.stop()


def test_a_dead_peer_leaves_the_table_at_the_heartbeat_timeout(faked: Any) -> None:
    server, clock = faked
    front: SwarmFront = server.front
    full(server, ("a", "b", "c"))
    clock.now += 20.0
    assert beat(server, "a").status_code == 200 and beat(server, "b").status_code == 200

    async def check() -> list[str]:
        return front.membership.inner.check_health()

    clock.now += 15.0  # c: 35 s silent; a and b: 15 s
    assert server._call(check()) == ["c"]
    assert table(server) == {0: ["a"], 1: ["b"]}
    st = server.status()
    assert st["swarm"]["stages"][0]["assigned"] == ["a"] and st["worker_deaths"] == 1
    # The stage's table outlives its replicas: a replacement must match it.
    assert register(server, "e").json()["stage"] == 0
    assert_error(ready(server, "e", 0, TABLES[1]), 409, "params_mismatch")


def test_status_and_metrics_show_stages_throughput_bytes_and_reroutes(
    make_server: ServerFactory,
) -> None:
    server = make_server(swarm=True, stages=3, min_replicas=1, **FAST)
    full(server, ("a", "b", "c"))
    fwd = {"boundary": 0, "direction": "forward", "bytes": 6800, "tokens": 100}
    assert beat(server, "a", throughput=12.5, boundaries=[fwd], reroutes=2, recoveries=2).ok
    assert beat(server, "b", throughput=10.0).ok
    st = server.status()
    assert Status.from_json(st).to_json() == st
    sw = st["swarm"]
    assert (sw["num_stages"], sw["min_replicas"], sw["reroutes"], sw["recoveries"]) == (3, 1, 2, 2)
    assert [s["ready"] for s in sw["stages"]] == [["a"], ["b"], ["c"]]
    assert [s["throughput"] for s in sw["stages"]] == [12.5, 10.0, None]
    assert sw["stages"][0]["num_params"] == 16 * 8 + 16
    assert sw["boundaries"] == [{**fwd, "bytes_per_token": 68.0}]
    assert st["mode"] == "swarm"
    shown = render_status(Status.from_json(st))  # diloco status
    assert "mode swarm  3 stages" in shown and "stage 0: 1/1 ready  12.5 samples/s" in shown
    assert "boundary 0 forward" in shown and "68.0 B/token" in shown
    metrics = requests.get(url(server, "/metrics"), timeout=TIMEOUT).text
    assert 'diloco_swarm_replicas{stage="2"} 1' in metrics
    assert 'diloco_swarm_stage_throughput{stage="0"} 12.5' in metrics
    assert 'diloco_swarm_boundary_bytes_per_token{boundary="0",direction="forward"} 68' in metrics
    assert "diloco_swarm_reroutes_total 2" in metrics
    assert 'diloco_info{mode="swarm"' in metrics


def test_strangers_get_401_and_malformed_bodies_400_on_every_swarm_route(
    make_server: ServerFactory,
) -> None:
    server = make_server(swarm=True, stages=2, min_replicas=1, token=TOKEN, **FAST)
    assert register(server, "a", **AUTH).json()["stage"] == 0
    assert ready(server, "a", 0).status_code == 401
    assert post_json(server, "/swarm/suspect", {}).status_code == 401
    assert routes(server).status_code == 401
    assert routes(server, **AUTH).status_code == 200
    bad_address = {"worker_id": "a", "stage": 0, "params": TABLES[0], "address": "ftp://x"}
    for path, body in (
        ("/swarm/ready", bad_address),
        ("/swarm/ready", {"worker_id": "a", "stage": -1, "params": TABLES[0]}),
        ("/swarm/suspect", {"worker_id": "a", "suspect": "b", "stage": "0"}),
        ("/swarm/suspect", {"worker_id": "a", "suspect": "b", "stage": 0, "typo": 1}),
    ):
        reply = assert_error(post_json(server, path, body, AUTH), 400, "bad_field")
        assert reply["detail"], reply
    resp = requests.get(url(server, "/swarm/routes?version=x"), headers=AUTH, timeout=TIMEOUT)
    assert_error(resp, 400, "bad_query")
    resp = requests.post(
        url(server, "/swarm/ready"),
        data=b"[1",
        headers={**AUTH, **CLIENT, "Content-Type": "application/json"},
        timeout=TIMEOUT,
    )
    assert_error(resp, 400, "bad_json")
    assert server.status()["swarm"]["stages"][0]["ready"] == []


def test_each_mode_refuses_the_others_routes(make_server: ServerFactory) -> None:
    swarm = make_server(swarm=True, stages=2, **FAST)
    plain = make_server(**FAST)
    assert_error(routes(plain), 409, "not_swarm_mode")
    assert_error(ready(plain, "a", 0), 409, "not_swarm_mode")
    ask = {"worker_id": "a", "round": 0}
    # Stage sync is served: a peer not registered has no stage, so no quorum (410).
    assert_error(post_json(swarm, "/quorum", ask), 410, "unknown_worker")
    resp = requests.get(url(swarm, "/global_params"), timeout=TIMEOUT)
    assert_error(resp, 409, "swarm_mode")


def test_swarm_settings_that_clash_are_refused_at_start() -> None:
    with pytest.raises(ValueError, match="--swarm .* cannot go with --allreduce"):
        ServerConfig(swarm=True, allreduce=True)
    with pytest.raises(ValueError, match="stages must be in"):
        ServerConfig(swarm=True, stages=1)
    with pytest.raises(ValueError, match="min_replicas must be >= 1"):
        ServerConfig(swarm=True, min_replicas=0)
