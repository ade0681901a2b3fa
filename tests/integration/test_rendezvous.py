"""All-reduce mode's rendezvous on the server's authenticated API (``POST /rendezvous/<op>``,
server/allreduce/rendezvous.py, server/web/rendezvous_routes.py): without the token, or from a
worker outside the quorum, nothing is read, written, waited on or deleted; bounds refuse before
anything is stored; a quorum's keys live as long as the book says; gloo builds its groups on it
(worker/allreduce/http_store.py), one per rank position of a quorum. A real server on loopback,
members in threads."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import requests
import torch

from diloco.server.allreduce.rendezvous import KEYS_BASE, KEYS_PER_MEMBER
from diloco.server.server import DiLoCoServer
from diloco.server.web.rendezvous_routes import BODY_LIMIT
from diloco.wire.messages import Rendezvous
from diloco.wire.messages.rendezvous import (
    KEY_LIMIT,
    POSITIONS_LIMIT,
    VALUE_LIMIT,
    StoreGet,
    encode,
)
from diloco.worker.allreduce.collective import QuorumCollective, average
from diloco.worker.allreduce.http_store import HttpMeeting
from diloco.worker.transport.client import DiLoCoClient, Unreachable
from tests.helpers.http import AUTH, TOKEN, assert_error, post_json
from tests.helpers.ranks import free_port
from tests.helpers.servers import ServerFactory
from tests.helpers.threads import in_threads

TABLE = [["w", [4]]]
FAST = {"poll_timeout": 5.0, "join_timeout": 0.0, "heartbeat_timeout": 0.0}
WRONG = {"Authorization": "Bearer not-the-token"}
#: One well-formed call of each op, as a member would send it (``who`` is added).
CALLS: dict[str, dict[str, Any]] = {
    "set": {"key": "k", "value": encode(b"stranger")},
    "get": {"key": "k"},
    "add": {"key": "n", "amount": 1},
    "compare_set": {"key": "k", "expected": encode(b"v"), "desired": encode(b"stranger")},
    "wait": {"keys": ["k"]},
    "delete": {"key": "k"},
    "count": {},
}


def call(
    server: DiLoCoServer, op: str, who: str, qid: str, headers: dict[str, str] | None = None,
    **fields: Any,
) -> requests.Response:  # fmt: skip
    body = {"worker_id": who, "quorum_id": qid, **fields}
    return post_json(server, f"/rendezvous/{op}", body, AUTH if headers is None else headers)


def ok(resp: requests.Response) -> dict[str, Any]:
    assert resp.status_code == 200, resp.text
    reply: dict[str, Any] = resp.json()
    return reply


def register(server: DiLoCoServer, *workers: str) -> None:
    for w in workers:
        resp = post_json(server, "/register", {"worker_id": w, "info": {"params": TABLE}}, AUTH)
        assert resp.status_code == 200, resp.text


def quorum_of(server: DiLoCoServer, *workers: str) -> list[dict[str, Any]]:
    """Register ``workers`` and form their quorum (the replies, by rank)."""
    register(server, *workers)
    server.front.expect(len(workers))  # type: ignore[attr-defined]

    def ask(w: str) -> dict[str, Any]:
        body = {"worker_id": w, "round": 0, "hash": "h0"}
        return ok(post_json(server, "/quorum", body, AUTH))

    with ThreadPoolExecutor(len(workers)) as pool:
        return list(pool.map(ask, workers))


@pytest.fixture
def server(make_server: ServerFactory) -> DiLoCoServer:
    # Failed authentications are not throttled here: every one must be seen to be a 401.
    return make_server(
        allreduce=True, token=TOKEN, collective_timeout=2.0, auth_failure_limit=1000, **FAST
    )


def held(server: DiLoCoServer, qid: str, who: str = "w-a") -> tuple[int, str]:
    """(keys held, key k's value) as a member reads them."""
    count = ok(call(server, "count", who, qid))["value"]
    got = ok(call(server, "get", who, qid, key="k"))
    return count, got["value"]


@pytest.mark.timeout(60)
def test_without_the_token_nothing_is_read_written_waited_on_or_deleted(
    server: DiLoCoServer,
) -> None:
    qa, _ = quorum_of(server, "w-a", "w-b")
    qid = qa["quorum_id"]
    ok(call(server, "set", "w-a", qid, key="k", value=encode(b"v")))
    before = held(server, qid)
    assert before == (1, encode(b"v"))
    for headers in ({}, WRONG):
        for op, fields in CALLS.items():
            resp = call(server, op, "w-a", qid, headers, **fields)
            assert_error(resp, 401, "unauthorized")
            assert encode(b"v") not in resp.text  # no value leaks
    assert held(server, qid) == before


@pytest.mark.timeout(60)
def test_a_token_holder_outside_the_quorum_is_refused_every_op(server: DiLoCoServer) -> None:
    qa, _ = quorum_of(server, "w-a", "w-b")
    qid = qa["quorum_id"]
    ok(call(server, "set", "w-b", qid, key="k", value=encode(b"v")))
    before = held(server, qid)
    register(server, "w-z")  # holds the token, registered after the quorum formed
    for stranger in ("w-z", "nobody"):  # registered but not a member; not even registered
        for op, fields in CALLS.items():
            assert_error(call(server, op, stranger, qid, **fields), 403, "not_a_member")
    assert held(server, qid) == before
    assert_error(call(server, "count", "w-a", "no-such-quorum"), 404, "unknown_quorum")
    assert_error(call(server, "count", "w-a", "a/b"), 400, "bad_field")


@pytest.mark.timeout(60)
def test_bounds_refuse_before_anything_is_stored(server: DiLoCoServer) -> None:
    qa, _ = quorum_of(server, "w-a", "w-b")
    qid = qa["quorum_id"]
    ok(call(server, "set", "w-a", qid, key="k", value=encode(b"v")))
    big_key = "x" * (KEY_LIMIT + 1)
    assert_error(call(server, "set", "w-a", qid, key=big_key, value=""), 400, "bad_field")
    big = encode(b"\0" * (VALUE_LIMIT + 1))
    assert_error(call(server, "set", "w-a", qid, key="big", value=big), 400, "bad_field")
    assert_error(call(server, "set", "w-a", qid, key="bad", value="not base64!"), 400, "bad_field")
    resp = call(server, "set", "w-a", qid, key="pad", value=encode(b"v"), pad="x" * BODY_LIMIT)
    assert_error(resp, 413, "body_too_large")
    assert held(server, qid) == (1, encode(b"v"))
    ok(call(server, "set", "w-a", qid, key="k", value=encode(b"\0" * VALUE_LIMIT)))  # the most
    # Keys per quorum: proportional to its size; the one past the bound stores nothing.
    limit = KEYS_BASE + KEYS_PER_MEMBER * 2
    for i in range(limit - 1):
        ok(call(server, "set", "w-a", qid, key=f"f{i}", value=""))
    assert_error(call(server, "set", "w-a", qid, key="one-more", value=""), 413, "store_full")
    assert_error(call(server, "add", "w-a", qid, key="one-more", amount=1), 413, "store_full")
    assert ok(call(server, "count", "w-a", qid))["value"] == limit
    ok(call(server, "set", "w-a", qid, key="k", value=encode(b"w")))  # an existing key: fine
    assert ok(call(server, "wait", "w-a", qid, keys=["one-more"]))["ready"] is False


@pytest.mark.timeout(60)
def test_a_wait_times_out_cleanly_within_the_collective_timeout(server: DiLoCoServer) -> None:
    qa, _ = quorum_of(server, "w-a", "w-b")
    qid = qa["quorum_id"]
    began = time.monotonic()
    assert ok(call(server, "wait", "w-a", qid, keys=["absent"], wait=0.5))["ready"] is False
    assert 0.5 <= time.monotonic() - began < 2.0
    began = time.monotonic()  # asked for an hour: cut to the collective timeout (2 s)
    assert ok(call(server, "get", "w-a", qid, key="absent", wait=3600))["found"] is False
    assert 2.0 <= time.monotonic() - began < 4.0
    assert ok(call(server, "count", "w-a", qid))["value"] == 0


@pytest.mark.timeout(60)
def test_a_quorums_keys_go_when_it_completes_a_discarded_ones_at_the_next_completion(
    server: DiLoCoServer,
) -> None:
    def outcome(w: str, qid: str, **fields: Any) -> None:
        ok(post_json(server, "/quorum/outcome", {"worker_id": w, "quorum_id": qid, **fields}, AUTH))

    first = quorum_of(server, "w-a", "w-b")[0]["quorum_id"]
    ok(call(server, "set", "w-a", first, key="k", value=encode(b"1")))
    outcome("w-a", first, ok=False, error="a member died")  # discarded
    assert held(server, first) == (1, encode(b"1"))  # a member may still be connecting
    second = quorum_of(server, "w-a", "w-b")[0]["quorum_id"]
    ok(call(server, "set", "w-b", second, key="k", value=encode(b"2")))
    for w in ("w-a", "w-b"):
        outcome(w, second, ok=True, round=1, hash="h1")
    for qid in (first, second):
        assert_error(call(server, "count", "w-a", qid), 410, "quorum_ended")
        assert_error(call(server, "set", "w-a", qid, key="k", value=""), 410, "quorum_ended")
    assert server.front.rendezvous.held() == {}  # type: ignore[attr-defined]


def test_the_server_mode_refuses_rendezvous_calls(make_server: ServerFactory) -> None:
    plain = make_server(num_workers=1)
    assert_error(call(plain, "count", "w-a", "q-1"), 409, "server_mode")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", [2, 3])
def test_members_in_threads_build_gloo_through_the_store_and_average(
    server: DiLoCoServer, size: int
) -> None:
    workers = [f"w-{c}" for c in "abc"[:size]]
    assigned = quorum_of(server, *workers)
    clients = [DiLoCoClient(server.address, token=TOKEN, retries=0) for _ in workers]

    def member(i: int) -> list[torch.Tensor]:
        q = assigned[i]
        meeting = HttpMeeting(clients[i], workers[i], Rendezvous.from_json(q["rendezvous"]))
        with QuorumCollective.build(meeting, q["quorum_id"], q["rank"], size, 5.0) as group:
            tensors = [torch.full((5,), float(q["rank"] + 1))]
            average(group, tensors, 1.0)
        return tensors

    try:
        results = in_threads(size, member, timeout=30)
    finally:
        for c in clients:
            c.close()
    mean = sum(range(1, size + 1)) / size
    for got in results:
        torch.testing.assert_close(got[0], torch.full((5,), mean))
    # Each member's joining thread closed its HTTP session: nothing left per round.
    assert all(not c._sessions for c in clients)


@pytest.mark.timeout(60)
def test_positions_over_http_are_key_spaces_with_the_quorums_members_and_life(
    server: DiLoCoServer,
) -> None:
    def at(position: int, who: str = "w-a") -> tuple[int, str]:
        count = ok(call(server, "count", who, qid, position=position))["value"]
        return count, ok(call(server, "get", who, qid, key="k", position=position))["value"]

    def outcome(w: str) -> None:
        body = {"worker_id": w, "quorum_id": qid, "ok": True, "round": 1, "hash": "h1"}
        ok(post_json(server, "/quorum/outcome", body, AUTH))

    qid = quorum_of(server, "w-a", "w-b")[0]["quorum_id"]
    ok(call(server, "set", "w-a", qid, key="k", value=encode(b"zero")))
    ok(call(server, "set", "w-b", qid, key="k", value=encode(b"one"), position=1))
    assert at(0) == (1, encode(b"zero")) and at(1, "w-b") == (1, encode(b"one"))
    register(server, "w-z")
    for position in (0, 1, POSITIONS_LIMIT - 1):  # a stranger, at any position: every op
        for op, fields in CALLS.items():
            resp = call(server, op, "w-z", qid, position=position, **fields)
            assert_error(resp, 403, "not_a_member")
    for bad in (-1, POSITIONS_LIMIT, "1", True, 1.5):  # refused before the store is asked
        for op, fields in CALLS.items():
            resp = call(server, op, "w-a", qid, position=bad, **fields)
            assert_error(resp, 400, "bad_field")
    assert at(0) == (1, encode(b"zero")) and at(1) == (1, encode(b"one"))
    assert server.front.rendezvous.held() == {qid: 2}  # type: ignore[attr-defined]
    for w in ("w-a", "w-b"):
        outcome(w)  # the quorum completes: its keys go, at every position
    for position in (0, 1, 2):
        assert_error(call(server, "count", "w-a", qid, position=position), 410, "quorum_ended")
    assert server.front.rendezvous.held() == {}  # type: ignore[attr-defined]


@pytest.mark.timeout(60)
def test_two_gloo_groups_of_one_quorum_at_two_positions_both_average(
    server: DiLoCoServer,
) -> None:
    """Two worker groups of two ranks, sharded alike: rank r of each averages with the other's
    rank r, in a group built at position r. Position 1's group is built while position 0's
    lives and its keys are held; then both average (four threads)."""
    workers = ("w-a", "w-b")
    assigned = quorum_of(server, *workers)
    qid = assigned[0]["quorum_id"]
    clients = [DiLoCoClient(server.address, token=TOKEN, retries=0) for _ in range(4)]
    built = [threading.Event() for _ in range(4)]

    def member(i: int) -> list[torch.Tensor]:
        position, q = divmod(i, 2)  # threads 0, 1 at position 0; 2, 3 at position 1
        if position == 1:
            assert built[0].wait(20) and built[1].wait(20)
        where = Rendezvous.from_json(assigned[q]["rendezvous"])
        meeting = HttpMeeting(clients[i], workers[q], where, position)
        with QuorumCollective.build(meeting, qid, assigned[q]["rank"], 2, 5.0) as group:
            built[i].set()
            assert all(b.wait(20) for b in built)  # both groups live at once
            tensors = [torch.full((3,), float(10 * position + assigned[q]["rank"] + 1))]
            average(group, tensors, 1.0)
        return tensors

    try:
        results = in_threads(4, member, timeout=30)
    finally:
        for c in clients:
            c.close()
    for i, got in enumerate(results):
        position = i // 2  # the mean of its own position's two ranks, not the other's
        torch.testing.assert_close(got[0], torch.full((3,), 10 * position + 1.5))
    # Each group's keys went to its own position: as many at each.
    counts = [ok(call(server, "count", "w-a", qid, position=p))["value"] for p in (0, 1)]
    assert counts[0] > 0 and counts[0] == counts[1], counts


def test_a_rendezvous_call_is_tried_once_the_keys_died_with_the_server() -> None:
    """A server that cannot be reached has lost its quorums' keys (a restarted one never knew
    them): the call fails at once instead of holding the member away from registering again
    through the client's retries (here 5, with a backoff that would take seconds)."""
    port = free_port()  # closed again: nothing listens there
    client = DiLoCoClient(f"127.0.0.1:{port}", retries=5, backoff=5.0, connect_timeout=2.0)
    with pytest.raises(Unreachable, match="after 1 attempts"):
        client.rendezvous("/rendezvous", "get", StoreGet(worker_id="w0", quorum_id="q-1", key="0"))
    assert client.retry_count == 0
