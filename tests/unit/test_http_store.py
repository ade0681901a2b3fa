"""The worker's rendezvous store (worker/allreduce/http_store.py) as its calls go out: bound to
one quorum and one rank position, it names the position in every call but position 0's, whose
bodies stay as they were before positions existed. A recording client, no server."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from diloco.wire.messages import Rendezvous
from diloco.wire.messages.rendezvous import POSITIONS_LIMIT, StoreCall, encode
from diloco.worker.allreduce.http_store import HttpMeeting, HttpStore
from diloco.worker.transport.client import DiLoCoClient

REPLIES: dict[str, dict[str, Any]] = {
    "set": {"status": "ok"},
    "get": {"found": True, "value": encode(b"v")},
    "add": {"value": 1},
    "compare_set": {"found": True, "value": encode(b"v")},
    "wait": {"ready": True},
    "delete": {"deleted": True},
    "count": {"value": 1},
}


class Recording:
    """What ``HttpStore`` uses of a ``DiLoCoClient``: its timeouts and ``rendezvous``."""

    base_url = "http://127.0.0.1:1"
    timeout = (1.0, 30.0)

    def __init__(self) -> None:
        self.bodies: list[tuple[str, dict[str, Any]]] = []

    def rendezvous(self, path: str, op: str, body: StoreCall) -> dict[str, Any]:
        # A long poll's ``wait`` is what is left of its deadline: it varies by a hair.
        self.bodies.append((op, {k: v for k, v in body.to_json().items() if k != "wait"}))
        return REPLIES[op]


def every_op(store: HttpStore) -> None:
    store.set("k", b"v")
    store.get("k")
    store.add("n", 1)
    store.compare_set("k", b"v", b"w")
    store.wait(["k"], timedelta(seconds=1))
    store.check(["k"])
    store.delete_key("k")
    store.num_keys()


def sent(position: int | None) -> list[tuple[str, dict[str, Any]]]:
    client = Recording()
    meeting = (
        HttpMeeting(client, "w-a", Rendezvous(path="/r"))  # type: ignore[arg-type]
        if position is None
        else HttpMeeting(client, "w-a", Rendezvous(path="/r"), position)  # type: ignore[arg-type]
    )
    every_op(meeting.store("q-1", 5.0))
    return client.bodies


def test_position_0_sends_the_bodies_of_before_and_another_position_names_itself() -> None:
    plain = sent(None)
    assert sent(0) == plain
    assert len(plain) == 8
    for _, body in plain:
        assert "position" not in body and body["worker_id"] == "w-a"
        assert body["quorum_id"] == "q-1"
    at_3 = sent(3)
    assert [op for op, _ in at_3] == [op for op, _ in plain]
    for (_, before), (_, body) in zip(plain, at_3, strict=True):
        assert body == {**before, "position": 3}


@pytest.mark.parametrize("position", [-1, POSITIONS_LIMIT])
def test_a_position_outside_the_range_is_refused_at_construction(position: int) -> None:
    client: DiLoCoClient = Recording()  # type: ignore[assignment]
    with pytest.raises(ValueError, match="position"):
        HttpStore(client, "/r", "w-a", "q-1", 5.0, position)
    with pytest.raises(ValueError, match="position"):
        HttpMeeting(client, "w-a", Rendezvous(path="/r"), position)
