"""The swarm peer's pure parts: the coordinator-backed routes' suspect rule (a fake client, no
sockets) and the heartbeat's swarm section from a peer's stats."""

from __future__ import annotations

from typing import Any

from diloco.swarm import CoordinatorRoutes, Endpoint
from diloco.swarm.peer_beats import swarm_beat
from diloco.wire.messages.swarm import Replica, RouteTable, StageRoutes


class FakeClient:
    def __init__(self, noted: int) -> None:
        self.noted, self.reports = noted, []

    def suspect(self, worker_id: str, *, suspect: str, stage: int, reason: str) -> dict[str, Any]:
        self.reports.append((worker_id, suspect, stage, reason))
        return {"version": self.noted}


def table(version: int, body: list[str]) -> RouteTable:
    replicas = tuple(Replica(peer_id=a, address=f"http://{a}:1") for a in body)
    return RouteTable(
        version=version,
        num_stages=2,
        stages=(StageRoutes(stage=0), StageRoutes(stage=1, replicas=replicas)),
    )


def test_a_suspect_is_reported_left_out_and_back_only_when_a_newer_table_lists_it() -> None:
    client = FakeClient(noted=4)
    routes = CoordinatorRoutes(client, "head", "tok")  # type: ignore[arg-type]
    routes.adopt(table(3, ["a", "b"]))
    assert routes.endpoints(1) == [Endpoint("http://a:1", "tok"), Endpoint("http://b:1", "tok")]
    routes.suspect(Endpoint("http://a:1", "tok"), "reset")
    assert client.reports == [("head", "a", 1, "reset")]
    assert [e.url for e in routes.endpoints(1)] == ["http://b:1"]
    routes.adopt(table(3, ["a", "b"]))  # an answer older than the report: still out
    routes.adopt(table(4, ["b"]))  # the coordinator's table without it
    assert [e.url for e in routes.endpoints(1)] == ["http://b:1"]
    routes.adopt(table(5, ["b", "a"]))  # it heartbeat again: back, in the table's order
    assert [e.url for e in routes.endpoints(1)] == ["http://b:1", "http://a:1"]
    assert routes.suspects == {}
    assert routes.wait_for(range(1, 2), 0.0) and not routes.wait_for(range(0, 2), 0.0)


def test_the_heartbeat_carries_the_bytes_sent_per_boundary_and_direction() -> None:
    stats = {
        "sent": {
            "0->1:forward": {"bytes": 100, "tokens": 4, "bytes_per_token": 25.0},
            "1->2:backward": {"bytes": 60, "tokens": 2, "bytes_per_token": 30.0},
        },
        "reroutes": 2,
        "recoveries": 1,
        "recomputes": 3,
    }
    beat = swarm_beat(stats, 12.5).to_json()
    assert beat == {
        "throughput": 12.5,
        "boundaries": [
            {"boundary": 0, "direction": "forward", "bytes": 100, "tokens": 4},
            {"boundary": 1, "direction": "backward", "bytes": 60, "tokens": 2},
        ],
        "reroutes": 2,
        "recoveries": 1,
        "recomputes": 3,
    }
