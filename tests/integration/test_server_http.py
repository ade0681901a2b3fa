"""The server's HTTP surface against a real server on loopback: every error status with its JSON
body, no state change from any rejected request, and the arithmetic of closed rounds."""

from __future__ import annotations

import http.client
import json
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import requests
import safetensors.torch
import torch

from diloco.server.config import ServerConfig
from diloco.server.server import DiLoCoServer
from diloco.wire import TensorSpec, encode, spec_of
from diloco.worker.transport.client import Conflict, DiLoCoClient, UnknownWorker
from tests.helpers.http import (
    AUTH,
    CLIENT,
    EXACT,
    TIMEOUT,
    TOKEN,
    accept,
    assert_error,
    assert_params_equal,
    assert_unchanged,
    body,
    expected_exact,
    finish_round0,
    parse_safetensors_metadata,
    post_json,
    post_raw,
    pseudo_grad,
    register,
    state,
    status,
    submit,
    url,
    wait_round,
)
from tests.helpers.servers import ServerFactory, initial_params

# --- fixtures and helpers ----------------------------------------------------------------------


































@pytest.fixture
def two_workers(make_server: ServerFactory) -> DiLoCoServer:
    """Round 0 open with workers a and b; a has already contributed."""
    server = make_server(num_workers=2, **EXACT)
    register(server, "a")
    register(server, "b")
    accept(server, body("a", 0, "a-0", seed=1))
    return server




# --- basics ------------------------------------------------------------------------------------


def test_healthz_register_status_and_download(make_server: ServerFactory) -> None:
    server = make_server(num_workers=2)
    assert requests.get(url(server, "/healthz"), timeout=TIMEOUT).json() == {"status": "ok"}
    reply = register(server, "a")
    assert reply["round"] == 0 and reply["has_params"] is True and reply["num_workers"] == 2
    assert sorted(reply["params"]) == [["b", [4]], ["w", [3, 4]]]
    st = status(server)
    assert st["opened"] is False and st["registrations"] == 1
    resp = requests.get(url(server, "/global_params"), timeout=TIMEOUT)
    assert resp.status_code == 200
    tensors = safetensors.torch.load(resp.content)
    assert_params_equal(tensors, initial_params())
    meta = parse_safetensors_metadata(resp.content)
    assert meta["round"] == "0"


# --- 400 ---------------------------------------------------------------------------------------


def _raw_header(header: bytes, payload: bytes = b"") -> bytes:
    return struct.pack("<Q", len(header)) + header + payload


def _good() -> bytes:
    return body("b", 0, "b-bad", seed=9)


BAD_BODIES: dict[str, tuple[Callable[[], bytes], str, str]] = {
    "header_not_json": (lambda: _raw_header(b'{"w": nope}     '), "bad_header", "JSON"),
    "header_not_object": (lambda: _raw_header(b"[1, 2]  "), "bad_header", "object"),
    "header_length_too_small": (lambda: struct.pack("<Q", 1) + b"{", "bad_header", "too small"),
    "empty_body": (lambda: b"", "truncated", "8 bytes early"),
    "body_inside_prefix": (lambda: b"\x10\x00\x00", "truncated", "5 bytes early"),
    "header_cut_short": (lambda: _good()[:20], "truncated", "early"),
    "payload_truncated": (lambda: _good()[:-5], "truncated", "5 bytes early"),
    "trailing_bytes": (lambda: _good() + b"xy", "trailing_bytes", "past the last tensor"),
    "unknown_tensor": (
        lambda: body("b", 0, "b-bad", {**pseudo_grad(9), "c": torch.zeros(4)}),
        "unknown_tensor",
        "'c'",
    ),
    "missing_tensor": (
        lambda: body("b", 0, "b-bad", {"w": pseudo_grad(9)["w"]}),
        "missing_tensor",
        "'b'",
    ),
    "wrong_shape": (
        lambda: body("b", 0, "b-bad", {"w": torch.zeros(4, 3), "b": torch.zeros(4)}),
        "shape_mismatch",
        "tensor 'w' has shape [4, 3], expected [3, 4]",
    ),
    "wrong_shape_flat": (
        lambda: body("b", 0, "b-bad", {"w": torch.zeros(12), "b": torch.zeros(4)}),
        "shape_mismatch",
        "expected [3, 4]",
    ),
    "dtype_f16": (
        lambda: body(
            "b", 0, "b-bad", {"w": torch.zeros(3, 4, dtype=torch.float16), "b": torch.zeros(4)}
        ),
        "dtype_mismatch",
        "tensor 'w' has dtype F16",
    ),
    "dtype_i64": (
        lambda: body(
            "b", 0, "b-bad", {"w": torch.zeros(3, 4), "b": torch.zeros(4, dtype=torch.int64)}
        ),
        "dtype_mismatch",
        "tensor 'b' has dtype I64",
    ),
    "dtype_f64": (
        lambda: body(
            "b", 0, "b-bad", {"w": torch.zeros(3, 4, dtype=torch.float64), "b": torch.zeros(4)}
        ),
        "dtype_mismatch",
        "F64",
    ),
    "unsupported_dtype_code": (
        lambda: _raw_header(
            b'{"w":{"dtype":"F8","shape":[3,4],"data_offsets":[0,12]},'
            b'"__metadata__":{"worker_id":"b","base_round":"0","submission_id":"x"}}',
            bytes(12),
        ),
        "bad_dtype",
        "'w'",
    ),
    "offsets_do_not_match_shape": (
        lambda: _raw_header(
            b'{"w":{"dtype":"F32","shape":[3,4],"data_offsets":[0,40]},'
            b'"__metadata__":{"worker_id":"b","base_round":"0","submission_id":"x"}}',
            bytes(40),
        ),
        "bad_header",
        "data_offsets",
    ),
    "metadata_not_strings": (
        lambda: _raw_header(b'{"__metadata__":{"base_round":0}}'),
        "bad_header",
        "__metadata__",
    ),
    "no_metadata": (lambda: encode(pseudo_grad(9)), "missing_metadata", "worker_id"),
    "no_worker_id": (lambda: body(None, 0, "b-bad", seed=9), "missing_metadata", "worker_id"),
    "empty_worker_id": (lambda: body("", 0, "b-bad", seed=9), "missing_metadata", "worker_id"),
    "no_submission_id": (lambda: body("b", 0, None, seed=9), "missing_metadata", "submission_id"),
    "no_base_round": (lambda: body("b", None, "b-bad", seed=9), "missing_metadata", "base_round"),
    "base_round_not_integer": (
        lambda: body("b", "zero", "b-bad", seed=9),
        "bad_metadata",
        "base_round",
    ),
    "base_round_fractional": (
        lambda: body("b", "0.5", "b-bad", seed=9),
        "bad_metadata",
        "base_round",
    ),
    "base_round_empty": (lambda: body("b", "", "b-bad", seed=9), "bad_metadata", "base_round"),
}


@pytest.mark.parametrize("case", sorted(BAD_BODIES))
def test_400_malformed_submission_changes_nothing(two_workers: DiLoCoServer, case: str) -> None:
    server = two_workers
    make, code, detail = BAD_BODIES[case]
    old = initial_params()
    before = state(server)
    reply = assert_error(submit(server, make()), 400, code)
    assert detail in reply["detail"], reply
    assert_unchanged(before, server)
    # b can still take part and the round sums exactly a's and b's contributions.
    finish_round0(server, old)


@pytest.mark.parametrize("weight", ["-1", "0", "nan", "inf", "heavy", ""])
def test_400_bad_weight_under_sample_weighting(make_server: ServerFactory, weight: str) -> None:
    server = make_server(num_workers=1, weighting="samples", **EXACT)
    register(server, "a")
    before = state(server)
    reply = assert_error(
        submit(server, body("a", 0, "a-0", seed=1, weight=weight)), 400, "bad_metadata"
    )
    assert "weight" in reply["detail"]
    assert_unchanged(before, server)


def test_weight_is_ignored_under_equal_weighting(make_server: ServerFactory) -> None:
    server = make_server(num_workers=2, **EXACT)
    register(server, "a")
    register(server, "b")
    accept(server, body("a", 0, "a-0", seed=1, weight="not-a-number"))
    accept(server, body("b", 0, "b-0", seed=2, weight=100))
    wait_round(server, 1)
    assert_params_equal(
        server.global_params(), expected_exact(initial_params(), pseudo_grad(1), pseudo_grad(2))
    )


BAD_JSON: list[tuple[str, bytes, str, str]] = [
    ("/register", b'{"worker_id": ', "bad_json", "not valid JSON"),
    ("/register", b"\xff\xfe{}", "bad_json", "not valid JSON"),
    ("/register", b"[1, 2]", "bad_json", "JSON object"),
    ("/register", b'"a"', "bad_json", "JSON object"),
    ("/register", b"3", "bad_json", "JSON object"),
    ("/register", b"null", "bad_json", "JSON object"),
    ("/register", b'{"worker_id": 7}', "bad_field", "'worker_id'"),
    ("/register", b'{"worker_id": ""}', "bad_field", "'worker_id'"),
    ("/register", json.dumps({"worker_id": "x" * 257}).encode(), "bad_field", "256"),
    ("/register", b'{"worker_id": "c", "hostname": 5}', "bad_field", "'hostname'"),
    ("/register", b'{"worker_id": "c", "info": []}', "bad_field", "'info'"),
    (
        "/register",
        b'{"worker_id": "c", "last_submission_id": 3}',
        "bad_field",
        "'last_submission_id'",
    ),
    ("/heartbeat", b"{", "bad_json", "not valid JSON"),
    ("/heartbeat", b"{}", "bad_field", "'worker_id'"),
    ("/heartbeat", b'{"worker_id": "a", "loss": "low"}', "bad_field", "loss"),
    ("/heartbeat", b'{"worker_id": "a", "loss": NaN}', "bad_field", "loss"),
    (
        "/heartbeat",
        b'{"worker_id": "a", "steps_per_second": true}',
        "bad_field",
        "steps_per_second",
    ),
    ("/deregister", b"[]", "bad_json", "JSON object"),
    ("/deregister", b'{"worker_id": null}', "bad_field", "'worker_id'"),
]


@pytest.mark.parametrize(("path", "raw", "code", "detail"), BAD_JSON)
def test_400_bad_json_bodies_change_nothing(
    two_workers: DiLoCoServer, path: str, raw: bytes, code: str, detail: str
) -> None:
    server = two_workers
    before = state(server)
    resp = post_raw(server, path, raw, {"Content-Type": "application/json"})
    reply = assert_error(resp, 400, code)
    assert detail in reply["detail"], reply
    assert_unchanged(before, server)
    finish_round0(server, initial_params())


def test_400_heartbeat_is_all_or_nothing(two_workers: DiLoCoServer) -> None:
    server = two_workers
    before = state(server)
    resp = post_json(
        server, "/heartbeat", {"worker_id": "a", "steps_per_second": 5.0, "loss": "low"}
    )
    assert_error(resp, 400, "bad_field")
    assert_unchanged(before, server)


@pytest.mark.parametrize("query", ["min_round=abc", "min_round=-1", "min_round=1.5"])
def test_400_bad_query(make_server: ServerFactory, query: str) -> None:
    server = make_server()
    reply = assert_error(
        requests.get(url(server, f"/global_params?{query}"), timeout=TIMEOUT), 400, "bad_query"
    )
    assert "min_round" in reply["detail"]


# --- 401 ---------------------------------------------------------------------------------------


def _auth_requests() -> dict[str, Callable[[DiLoCoServer, dict[str, str]], requests.Response]]:
    def json_call(
        path: str, payload: dict[str, Any]
    ) -> Callable[[DiLoCoServer, dict[str, str]], requests.Response]:
        return lambda server, headers: post_json(server, path, payload, headers)

    return {
        "register_new": json_call("/register", {"worker_id": "intruder"}),
        "register_existing": json_call("/register", {"worker_id": "b", "hostname": "elsewhere"}),
        "heartbeat": json_call(
            "/heartbeat", {"worker_id": "a", "loss": 1.5, "steps_per_second": 2.0}
        ),
        "deregister": json_call("/deregister", {"worker_id": "b"}),
        "submit": lambda server, headers: submit(server, body("b", 0, "b-0", seed=2), headers),
        "global_params": lambda server, headers: requests.get(
            url(server, "/global_params?worker_id=a"), headers=headers, timeout=TIMEOUT
        ),
        "status": lambda server, headers: requests.get(
            url(server, "/status"), headers=headers, timeout=TIMEOUT
        ),
        "initial_params": lambda server, headers: post_raw(
            server,
            "/initial_params?worker_id=a",
            encode(initial_params(), {"worker_id": "a"}),
            headers,
        ),
    }


BAD_AUTH: dict[str, dict[str, str]] = {
    "none": {},
    "wrong_token": {"Authorization": "Bearer secret-token-124"},
    "token_prefix": {"Authorization": "Bearer secret-token-12"},
    "token_extended": {"Authorization": f"Bearer {TOKEN}x"},
    "no_scheme": {"Authorization": TOKEN},
    "basic_scheme": {"Authorization": f"Basic {TOKEN}"},
    "empty": {"Authorization": ""},
    "other_header": {"X-Token": TOKEN},
}


@pytest.fixture
def token_server(make_server: ServerFactory) -> DiLoCoServer:
    server = make_server(num_workers=2, token=TOKEN, **EXACT)
    register(server, "a", AUTH)
    register(server, "b", AUTH)
    accept(server, body("a", 0, "a-0", seed=1), AUTH)
    return server


@pytest.mark.parametrize("auth", sorted(BAD_AUTH))
@pytest.mark.parametrize("endpoint", sorted(_auth_requests()))
def test_401_without_the_right_token_changes_nothing(
    token_server: DiLoCoServer, endpoint: str, auth: str
) -> None:
    server = token_server
    before = state(server)
    resp = _auth_requests()[endpoint](server, BAD_AUTH[auth])
    reply = assert_error(resp, 401, "unauthorized")
    assert "token" in reply["detail"]
    assert set(reply) == {"error", "detail"}
    assert_unchanged(before, server)


def test_401_for_a_non_utf8_authorization_header(token_server: DiLoCoServer) -> None:
    server = token_server
    resp = requests.get(
        url(server, "/status"), headers={"Authorization": b"Bearer \xff"}, timeout=TIMEOUT
    )
    assert_error(resp, 401, "unauthorized")


def test_401_healthz_is_open_and_the_right_token_works(token_server: DiLoCoServer) -> None:
    server = token_server
    assert requests.get(url(server, "/healthz"), timeout=TIMEOUT).status_code == 200
    assert (
        requests.get(
            url(server, "/healthz"), headers={"Authorization": "Bearer nope-nope"}, timeout=TIMEOUT
        ).status_code
        == 200
    )
    assert requests.get(url(server, "/status"), headers=AUTH, timeout=TIMEOUT).json()["round"] == 0
    resp = post_json(server, "/heartbeat", {"worker_id": "a", "loss": 1.5}, AUTH)
    assert resp.status_code == 200, resp.text
    resp = requests.get(url(server, "/global_params?worker_id=a"), headers=AUTH, timeout=TIMEOUT)
    assert resp.status_code == 200
    assert_params_equal(safetensors.torch.load(resp.content), initial_params())
    accept(server, body("b", 0, "b-0", seed=2), AUTH)
    wait_round(server, 1)
    assert_params_equal(
        server.global_params(), expected_exact(initial_params(), pseudo_grad(1), pseudo_grad(2))
    )
    # The client sends the token on every call, tensor endpoints included.
    client = DiLoCoClient(server.address, token=TOKEN, retries=0, read_timeout=TIMEOUT)
    try:
        assert client.status()["round"] == 1
        round_, params = client.get_global_params(min_round=1, worker_id="a")
        assert round_ == 1
        assert_params_equal(dict(params), server.global_params())
        assert client.deregister("b")["status"] == "ok"
    finally:
        client.close()
    assert [w["worker_id"] for w in status(server)["workers"]] == ["a"]


# --- 409 ---------------------------------------------------------------------------------------


def _conflict(
    server: DiLoCoServer, data: bytes, code: str, round_: int, action: str
) -> dict[str, Any]:
    before = state(server)
    rejected = status(server)["rejected_submissions"]
    reply = assert_error(submit(server, data), 409, code)
    assert reply["round"] == round_
    assert reply["action"] == action
    assert_unchanged(before, server)
    assert status(server)["rejected_submissions"] == rejected + 1
    return reply


def test_409_conflicts_carry_round_and_action(make_server: ServerFactory) -> None:
    server = make_server(num_workers=2, **EXACT)
    register(server, "a")
    register(server, "b")
    register(server, "late")  # joins after round 0 opened

    reply = _conflict(server, body("late", 0, "late-0", seed=3), "not_expected", 0, "continue")
    assert "round 1" in reply["detail"]
    _conflict(server, body("a", 1, "a-future", seed=1), "future_round", 0, "rebase")

    accept(server, body("a", 0, "a-0", seed=1))
    reply = _conflict(server, body("a", 0, "a-0-again", seed=4), "already_submitted", 0, "wait")
    assert "round 0" in reply["detail"]

    accept(server, body("b", 0, "b-0", seed=2))
    wait_round(server, 1)
    round1 = expected_exact(initial_params(), pseudo_grad(1), pseudo_grad(2))
    assert_params_equal(server.global_params(), round1)

    reply = _conflict(server, body("a", 0, "a-stale", seed=5), "stale_round", 1, "rebase")
    assert "round 0" in reply["detail"] and "round 1" in reply["detail"]
    _conflict(server, body("a", 5, "a-future", seed=5), "future_round", 1, "rebase")

    # The late joiner is expected from round 1 on: the round waits for it.
    accept(server, body("a", 1, "a-1", seed=6))
    accept(server, body("b", 1, "b-1", seed=7))
    assert status(server)["round"] == 1
    assert status(server)["expected"] == ["a", "b", "late"]
    accept(server, body("late", 1, "late-1", seed=8))
    wait_round(server, 2)
    assert_params_equal(
        server.global_params(),
        expected_exact(round1, pseudo_grad(6), pseudo_grad(7), pseudo_grad(8)),
    )


def test_409_client_raises_conflict_with_action(make_server: ServerFactory) -> None:
    server = make_server(num_workers=1)
    client = DiLoCoClient(server.address, retries=0, read_timeout=TIMEOUT)
    try:
        client.register("a")
        grads = pseudo_grad(1)
        specs = encode_specs(grads)
        client.submit_pseudogradients("a", 0, "a-0", specs, lambda s: grads[s.name])
        wait_round(server, 1)
        with pytest.raises(Conflict) as info:
            client.submit_pseudogradients("a", 0, "a-stale", specs, lambda s: grads[s.name])
        assert info.value.status == 409
        assert info.value.code == "stale_round"
        assert info.value.body["action"] == "rebase"
        assert info.value.body["round"] == 1
    finally:
        client.close()


def encode_specs(tensors: dict[str, torch.Tensor]) -> list[TensorSpec]:
    return [spec_of(n, t) for n, t in tensors.items()]


class _BlockingSGD(torch.optim.SGD):
    """SGD whose step waits for a signal, holding the round in its closing state."""

    entered: threading.Event
    release: threading.Event

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        self.entered.set()
        assert self.release.wait(TIMEOUT), "test never released the outer step"
        return super().step(closure)


def test_409_round_closing_while_the_outer_step_runs() -> None:
    entered, release = threading.Event(), threading.Event()

    def factory(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        opt = _BlockingSGD(params, lr=1.0)
        opt.entered, opt.release = entered, release
        return opt

    server = DiLoCoServer(
        ServerConfig(port=0, num_workers=2),
        initial_params=initial_params(),
        outer_optimizer_factory=factory,
    ).start()
    try:
        register(server, "a")
        register(server, "b")
        register(server, "late")
        accept(server, body("a", 0, "a-0", seed=1))
        accept(server, body("b", 0, "b-0", seed=2))
        assert entered.wait(TIMEOUT)
        st = status(server)
        assert st["closing"] is True and st["round"] == 0
        for data in (body("late", 0, "late-0", seed=3), body("a", 0, "a-again", seed=3)):
            reply = assert_error(submit(server, data), 409, "round_closing")
            assert reply["round"] == 0 and reply["action"] == "rebase"
        # A retry of a counted submission is still answered as a duplicate.
        dup = submit(server, body("a", 0, "a-0", seed=1))
        assert dup.status_code == 200 and _without_instance(dup.json()) == {
            "status": "duplicate",
            "round": 0,
            "submission_id": "a-0",
        }
        release.set()
        wait_round(server, 1)
        assert_params_equal(
            server.global_params(), expected_exact(initial_params(), pseudo_grad(1), pseudo_grad(2))
        )
    finally:
        release.set()
        server.stop()


def test_409_initial_params_when_the_server_has_them(make_server: ServerFactory) -> None:
    server = make_server()
    register(server, "a")
    before = state(server)
    resp = post_raw(
        server, "/initial_params?worker_id=a", encode({"w": torch.ones(3, 4), "b": torch.ones(4)})
    )
    assert_error(resp, 409, "already_initialized")
    assert_unchanged(before, server)


# --- 410 ---------------------------------------------------------------------------------------


UNKNOWN_CALLS: dict[str, Callable[[DiLoCoServer], requests.Response]] = {
    "heartbeat": lambda s: post_json(s, "/heartbeat", {"worker_id": "ghost"}),
    "deregister": lambda s: post_json(s, "/deregister", {"worker_id": "ghost"}),
    "submit": lambda s: submit(s, body("ghost", 0, "ghost-0", seed=3)),
    "global_params": lambda s: requests.get(
        url(s, "/global_params?worker_id=ghost"), timeout=TIMEOUT
    ),
    "global_params_long_poll": lambda s: requests.get(
        url(s, "/global_params?worker_id=ghost&min_round=1"), timeout=TIMEOUT
    ),
    "initial_params": lambda s: post_raw(
        s, "/initial_params?worker_id=ghost", encode(initial_params())
    ),
}


@pytest.mark.parametrize("call", sorted(UNKNOWN_CALLS))
def test_410_unknown_worker_changes_nothing(two_workers: DiLoCoServer, call: str) -> None:
    server = two_workers
    before = state(server)
    reply = assert_error(UNKNOWN_CALLS[call](server), 410, "unknown_worker")
    assert "'ghost'" in reply["detail"] and "register again" in reply["detail"]
    assert_unchanged(before, server)
    finish_round0(server, initial_params())


def test_410_after_deregistering(two_workers: DiLoCoServer) -> None:
    server = two_workers
    assert post_json(server, "/deregister", {"worker_id": "b"}).json()["status"] == "ok"
    # b left before submitting: a's contribution alone closes round 0.
    wait_round(server, 1)
    assert_params_equal(server.global_params(), expected_exact(initial_params(), pseudo_grad(1)))
    before = state(server)
    assert_error(post_json(server, "/deregister", {"worker_id": "b"}), 410, "unknown_worker")
    assert_error(post_json(server, "/heartbeat", {"worker_id": "b"}), 410, "unknown_worker")
    assert_error(submit(server, body("b", 1, "b-1", seed=2)), 410, "unknown_worker")
    assert_unchanged(before, server)
    client = DiLoCoClient(server.address, retries=0, read_timeout=TIMEOUT)
    try:
        with pytest.raises(UnknownWorker) as info:
            client.heartbeat("b")
        assert info.value.status == 410 and info.value.code == "unknown_worker"
    finally:
        client.close()


def test_leave_after_submitting_keeps_the_contribution(make_server: ServerFactory) -> None:
    server = make_server(num_workers=2, **EXACT)
    register(server, "a")
    register(server, "b")
    accept(server, body("a", 0, "a-0", seed=1))
    assert post_json(server, "/deregister", {"worker_id": "a"}).status_code == 200
    assert status(server)["round"] == 0
    accept(server, body("b", 0, "b-0", seed=2))
    st = wait_round(server, 1)
    assert st["expected"] == ["b"]
    assert_params_equal(
        server.global_params(), expected_exact(initial_params(), pseudo_grad(1), pseudo_grad(2))
    )


# --- 408 ---------------------------------------------------------------------------------------


def test_408_a_sender_quiet_mid_body_gives_up_its_buffer(
    make_server: ServerFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker that stops sending mid-upload without closing the connection (a dead machine:
    no FIN) must not hold the one receive buffer: its upload is dropped after ``body_timeout``,
    the next worker's upload goes through, and the partial body changes nothing."""
    server = make_server(num_workers=2, body_timeout=0.3, **EXACT)
    register(server, "a")
    register(server, "b")
    data = body("a", 0, "a-0", seed=1)
    head = (
        f"POST /submit_pseudograd HTTP/1.1\r\nHost: {server.address}\r\n"
        "Content-Type: application/octet-stream\r\nX-Diloco-Client: test\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", server.port), timeout=TIMEOUT) as quiet:
        quiet.sendall(head.encode() + data[:-10])  # then nothing, and the socket stays open
        deadline = time.monotonic() + TIMEOUT
        while status(server)["uploading"] != ["a"]:  # a holds the receive buffer
            assert time.monotonic() < deadline, "the quiet upload never started"
            time.sleep(0.005)
        # b's upload needs that buffer: it is accepted once a's read has given up.
        accept(server, body("b", 0, "b-0", seed=2))
        reply = http.client.HTTPResponse(quiet)
        reply.begin()
        assert reply.status == 408
        assert json.loads(reply.read())["error"] == "body_timeout"
    assert any("/submit_pseudograd from 127.0.0.1 dropped" in r.message for r in caplog.records)
    st = status(server)
    assert st["round"] == 0 and st["submitted"] == ["b"] and st["uploading"] == []
    assert_params_equal(server.global_params(), initial_params())
    # a's retry of the same submission counts once and closes the round.
    accept(server, data)
    wait_round(server, 1)
    assert_params_equal(
        server.global_params(), expected_exact(initial_params(), pseudo_grad(1), pseudo_grad(2))
    )


# --- 413 ---------------------------------------------------------------------------------------


def test_413_json_over_64k_with_content_length(two_workers: DiLoCoServer) -> None:
    server = two_workers
    before = state(server)
    big = {"worker_id": "c", "info": {"pad": "x" * (64 * 1024)}}
    reply = assert_error(post_json(server, "/register", big), 413, "body_too_large")
    assert "65536" in reply["detail"]
    for path in ("/heartbeat", "/deregister"):
        assert_error(
            post_json(server, path, {"worker_id": "a", "pad": "y" * 70000}), 413, "body_too_large"
        )
    assert_unchanged(before, server)


def test_413_json_over_64k_chunked(two_workers: DiLoCoServer) -> None:
    """No Content-Length: the limit must hold on the bytes actually read."""
    server = two_workers
    before = state(server)
    raw = json.dumps({"worker_id": "c", "info": {"pad": "x" * (80 * 1024)}}).encode()

    def gen() -> Iterator[bytes]:
        for i in range(0, len(raw), 8192):
            yield raw[i : i + 8192]

    resp = requests.post(
        url(server, "/register"),
        data=gen(),
        headers={"Content-Type": "application/json", **CLIENT},
        timeout=TIMEOUT,
    )
    assert resp.status_code == 413, resp.text
    assert resp.json()["error"] == "body_too_large"
    assert_unchanged(before, server)


def test_413_declared_header_length_over_16mib(two_workers: DiLoCoServer) -> None:
    server = two_workers
    before = state(server)
    data = struct.pack("<Q", 16 * 1024 * 1024 + 1) + b'{"w":'
    reply = assert_error(submit(server, data), 413, "header_too_large")
    assert str(16 * 1024 * 1024) in reply["detail"]
    data = struct.pack("<Q", 2**63) + b"{}"
    assert_error(submit(server, data), 413, "header_too_large")
    assert_unchanged(before, server)
    finish_round0(server, initial_params())


def _post_with_declared_length(
    server: DiLoCoServer, path: str, declared: int, sent: bytes
) -> tuple[int, dict[str, Any]]:
    """POST whose Content-Length promises more than is sent; the server must answer from the
    header alone."""
    host, port = server.address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=TIMEOUT)
    try:
        conn.putrequest("POST", path)
        conn.putheader("Content-Type", "application/octet-stream")
        conn.putheader("X-Diloco-Client", "test")
        conn.putheader("Content-Length", str(declared))
        conn.endheaders()
        conn.send(sent)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def test_413_content_length_larger_than_the_model_allows(two_workers: DiLoCoServer) -> None:
    server = two_workers
    before = state(server)
    model_bytes = status(server)["model_bytes"]
    assert model_bytes == (12 + 4) * 4
    limit = 16 * 1024 * 1024 + 8 + model_bytes
    code, reply = _post_with_declared_length(server, "/submit_pseudograd", limit + 1, _good()[:64])
    assert code == 413, reply
    assert reply["error"] == "body_too_large"
    assert str(limit + 1) in reply["detail"] and str(limit) in reply["detail"]
    assert_unchanged(before, server)
    finish_round0(server, initial_params())


# --- 422 ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_422_non_finite_pseudo_gradient(
    two_workers: DiLoCoServer, bad: float, dtype: torch.dtype
) -> None:
    server = two_workers
    before = state(server)
    poisoned = pseudo_grad(2, dtype)
    poisoned["b"] = poisoned["b"].clone()
    poisoned["b"][2] = bad
    reply = assert_error(submit(server, body("b", 0, "b-0", poisoned)), 422, "non_finite")
    assert "'b'" in reply["detail"]
    assert_unchanged(before, server)
    # The same submission id, now with finite values, is accepted: the failure left no trace.
    good = pseudo_grad(2, dtype)
    accept(server, body("b", 0, "b-0", good))
    wait_round(server, 1)
    assert_params_equal(
        server.global_params(), expected_exact(initial_params(), pseudo_grad(1), good)
    )


# --- 503 ---------------------------------------------------------------------------------------


def test_503_submit_before_any_parameters() -> None:
    server = DiLoCoServer(ServerConfig(port=0, num_workers=1)).start()
    try:
        register(server, "a")
        resp = submit(server, body("a", 0, "a-0", seed=1))
        assert_error(resp, 503, "no_parameters")
        assert_error(
            requests.get(url(server, "/global_params"), timeout=TIMEOUT), 503, "no_parameters"
        )
        st = status(server)
        assert st["has_params"] is False and st["bytes_in"] == 0 and st["submitted"] == []
    finally:
        server.stop()


# --- idempotency, arithmetic, long polls -------------------------------------------------------


def test_idempotent_retry_counts_once(make_server: ServerFactory) -> None:
    server = make_server(num_workers=2, **EXACT)
    register(server, "a")
    register(server, "b")
    data_a = body("a", 0, "a-0", seed=1)
    accept(server, data_a)
    bytes_after_first = status(server)["bytes_in"]
    assert bytes_after_first == len(data_a)
    for _ in range(2):
        resp = submit(server, data_a)
        assert resp.status_code == 200
        assert _without_instance(resp.json()) == {
            "status": "duplicate",
            "round": 0,
            "submission_id": "a-0",
        }
    st = status(server)
    assert st["bytes_in"] == bytes_after_first
    assert st["submitted"] == ["a"]
    assert st["rejected_submissions"] == 0
    assert {w["worker_id"]: w["submissions"] for w in st["workers"]} == {"a": 1, "b": 0}
    accept(server, body("b", 0, "b-0", seed=2))
    wait_round(server, 1)
    after = server.global_params()
    assert_params_equal(after, expected_exact(initial_params(), pseudo_grad(1), pseudo_grad(2)))
    # A retry after the round closed: still a duplicate, reported in the round it went into.
    resp = submit(server, data_a)
    assert _without_instance(resp.json()) == {
        "status": "duplicate",
        "round": 0,
        "submission_id": "a-0",
    }
    assert_params_equal(server.global_params(), after)
    assert status(server)["submitted"] == []
    # Registering again with the last submission id tells the worker it is in the parameters.
    reply = post_json(server, "/register", {"worker_id": "a", "last_submission_id": "a-0"}).json()
    assert reply["last_submission"] == {"counted_in": 0, "in_params": True}
    reply = post_json(server, "/register", {"worker_id": "a", "last_submission_id": "never"}).json()
    assert reply["last_submission"] == {"counted_in": None, "in_params": False}


def test_default_outer_optimizer_matches_a_hand_computation(make_server: ServerFactory) -> None:
    """SGD, lr 0.7, momentum 0.9, Nesterov, over two rounds (momentum carries over)."""
    server = make_server(num_workers=2)
    register(server, "a")
    register(server, "b")
    params = initial_params()
    momentum: dict[str, torch.Tensor] = {}
    for r in range(2):
        ga, gb = pseudo_grad(10 * r + 1), pseudo_grad(10 * r + 2)
        accept(server, body("a", r, f"a-{r}", ga))
        accept(server, body("b", r, f"b-{r}", gb))
        wait_round(server, r + 1)
        for name in params:
            g = (ga[name] + gb[name]) / 2
            momentum[name] = g.clone() if r == 0 else 0.9 * momentum[name] + g
            params[name] = params[name] - 0.7 * (g + 0.9 * momentum[name])
        got = server.global_params()
        for name in params:
            torch.testing.assert_close(got[name], params[name], rtol=1e-6, atol=1e-6)
    assert status(server)["outer_optimizer"] == {"lr": 0.7, "momentum": 0.9}


def test_submissions_before_round0_opens_are_held(make_server: ServerFactory) -> None:
    server = make_server(num_workers=2, **EXACT)
    register(server, "a")
    accept(server, body("a", 0, "a-0", seed=1))
    st = status(server)
    assert st["opened"] is False and st["submitted"] == ["a"] and st["round"] == 0
    register(server, "b")
    st = status(server)
    assert st["opened"] is True and st["round"] == 0 and st["expected"] == ["a", "b"]
    finish_round0(server, initial_params())


def test_long_poll_pending_then_new_round(make_server: ServerFactory) -> None:
    server = make_server(num_workers=2, poll_timeout=0.3, **EXACT)
    register(server, "a")
    register(server, "b")
    started = time.monotonic()
    resp = requests.get(url(server, "/global_params?min_round=1&worker_id=a"), timeout=TIMEOUT)
    waited = time.monotonic() - started
    assert resp.status_code == 202
    assert resp.json() == {"status": "pending", "round": 0}
    assert 0.25 <= waited < 5.0
    # An already reached round answers at once.
    now = requests.get(url(server, "/global_params?min_round=0"), timeout=TIMEOUT)
    assert now.status_code == 200
    assert parse_safetensors_metadata(now.content)["round"] == "0"

    results: list[requests.Response] = []

    def poll() -> None:
        while True:  # as a worker does: poll again on 202
            r = requests.get(url(server, "/global_params?min_round=1&worker_id=b"), timeout=TIMEOUT)
            if r.status_code != 202:
                results.append(r)
                return

    poller = threading.Thread(target=poll)
    poller.start()
    accept(server, body("a", 0, "a-0", seed=1))
    accept(server, body("b", 0, "b-0", seed=2))
    poller.join(TIMEOUT)
    assert not poller.is_alive()
    (got,) = results
    assert got.status_code == 200
    assert got.headers["Content-Type"] == "application/octet-stream"
    assert int(got.headers["Content-Length"]) == len(got.content)
    tensors = safetensors.torch.load(got.content)
    expected = expected_exact(initial_params(), pseudo_grad(1), pseudo_grad(2))
    assert_params_equal(tensors, expected)
    meta = parse_safetensors_metadata(got.content)
    assert meta["round"] == "1"
    assert meta["instance"] == status(server)["instance"]
    st = status(server)
    assert st["bytes_out"] >= len(got.content)
    # Only the 200 counts towards a worker's downloads; a's 202 and the anonymous download do not.
    assert {w["worker_id"]: w["bytes_out"] for w in st["workers"]} == {
        "a": 0,
        "b": len(got.content),
    }


def test_sample_weighting_averages_by_reported_weight(make_server: ServerFactory) -> None:
    server = make_server(num_workers=3, weighting="samples", **EXACT)
    for w in ("a", "b", "c"):
        register(server, w)
    weights = {"a": 1.0, "b": 3.0, "c": 0.5}
    grads = {w: pseudo_grad(i + 1) for i, w in enumerate(weights)}
    for w, weight in weights.items():
        accept(server, body(w, 0, f"{w}-0", grads[w], weight=weight))
    wait_round(server, 1)
    total = sum(weights.values())
    got = server.global_params()
    for name, p in initial_params().items():
        mean = sum(weights[w] * grads[w][name] for w in weights) / total
        torch.testing.assert_close(got[name], p - mean, rtol=1e-6, atol=1e-6)
    # Not what an equal average would give.
    equal = expected_exact(initial_params(), *grads.values())
    assert not torch.allclose(got["w"], equal["w"], atol=1e-3)


def test_client_submission_body_opens_with_safetensors(make_server: ServerFactory) -> None:
    """Capture the exact bytes DiLoCoClient streams and open them with the reference reader."""
    server = make_server(num_workers=1, **EXACT)
    client = DiLoCoClient(server.address, retries=0, read_timeout=TIMEOUT)
    captured: list[bytes] = []
    bulk = client._bulk
    real_post = bulk.post

    def capturing_post(
        path: str, params: Any, size: int, chunks: Any, limit: int
    ) -> tuple[int, bytes]:
        raw = b"".join(bytes(part) for part in chunks)
        captured.append(raw)
        assert size == len(raw)
        return real_post(path, params, size, [raw], limit)

    bulk.post = capturing_post  # type: ignore[method-assign]
    try:
        client.register("a")
        grads = {"w": pseudo_grad(1)["w"].to(torch.bfloat16), "b": pseudo_grad(1)["b"]}
        reply = client.submit_pseudogradients(
            "a", 0, "a-0", encode_specs(grads), lambda s: grads[s.name], weight=12.0
        )
        assert _without_instance(reply) == {
            "status": "accepted",
            "round": 0,
            "submission_id": "a-0",
        }
    finally:
        client.close()
    (raw,) = captured
    loaded = safetensors.torch.load(raw)
    assert loaded.keys() == grads.keys()
    for name in grads:
        assert loaded[name].dtype == grads[name].dtype
        assert torch.equal(loaded[name], grads[name])
    meta = parse_safetensors_metadata(raw)
    assert meta["worker_id"] == "a" and meta["base_round"] == "0" and meta["submission_id"] == "a-0"
    assert float(meta["weight"]) == 12.0
    assert status(server)["bytes_in"] == len(raw)
    wait_round(server, 1)
    assert_params_equal(
        server.global_params(),
        expected_exact(initial_params(), {"w": grads["w"].float(), "b": grads["b"]}),
    )


def test_encode_bodies_open_with_safetensors() -> None:
    data = body("a", 3, "a-3", seed=1, weight=2)
    loaded = safetensors.torch.load(data)
    assert_params_equal(loaded, pseudo_grad(1))
    assert parse_safetensors_metadata(data) == {
        "worker_id": "a",
        "base_round": "3",
        "submission_id": "a-3",
        "weight": "2",
    }


# --- JSON bodies arriving in pieces ------------------------------------------------------------


def _send_in_two_parts(
    server: DiLoCoServer, head: bytes, first: bytes, rest: bytes
) -> tuple[bytes, bytes]:
    """Send a request whose body arrives in two pieces, the second a moment after the first, as
    on a slow link. No server-side event exposes "handler waiting for body", so a short pause it
    is. Returns the status line and the reply body."""
    host, port = server.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=TIMEOUT) as sock:
        sock.sendall(head + first)
        time.sleep(0.2)
        sock.sendall(rest)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    head_part, _, reply_body = reply.partition(b"\r\n\r\n")
    return head_part.split(b"\r\n", 1)[0], reply_body


def test_json_body_arriving_in_two_segments(make_server: ServerFactory) -> None:
    server = make_server(num_workers=2)
    raw = json.dumps({"worker_id": "split", "hostname": "h"}).encode()
    head = (
        f"POST /register HTTP/1.1\r\nHost: {server.address}\r\nContent-Type: application/json\r\nX-Diloco-Client: test\r\n"
        f"Content-Length: {len(raw)}\r\nConnection: close\r\n\r\n"
    ).encode()
    status_line, reply = _send_in_two_parts(server, head, raw[:10], raw[10:])
    assert b" 200 " in status_line, reply
    assert "split" in [w["worker_id"] for w in status(server)["workers"]]


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def test_413_chunked_json_over_64k_with_a_valid_prefix(make_server: ServerFactory) -> None:
    server = make_server(num_workers=2)
    before = state(server)
    first = b'{"worker_id": "sneaky"}'
    rest = b" " * (80 * 1024)
    head = (
        f"POST /register HTTP/1.1\r\nHost: {server.address}\r\nContent-Type: application/json\r\nX-Diloco-Client: test\r\n"
        "Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
    ).encode()
    status_line, reply = _send_in_two_parts(
        server, head, _chunk(first), _chunk(rest) + b"0\r\n\r\n"
    )
    assert b" 413 " in status_line, reply
    assert json.loads(reply)["error"] == "body_too_large"
    assert_unchanged(before, server)


def _without_instance(reply: dict) -> dict:
    """Submission replies name the server instance (a random id per start)."""
    assert isinstance(reply.pop("instance"), str)
    return reply


def test_download_streams_a_round_while_its_outer_step_is_still_running(
    make_server: ServerFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    import diloco.core.finite as finite_mod  # the server steps through its FiniteGuard
    from diloco.server.web.app import DOWNLOAD_CHUNK

    n = 300_000  # three tensors of 1.2 MB: the first holds the first write (1 MiB) whole
    g = torch.Generator().manual_seed(5)
    params = {name: torch.randn(n, generator=g) for name in ("a", "b", "c")}
    grads = {name: torch.randn(n, generator=g) for name in ("a", "b", "c")}
    first_done, release = threading.Event(), threading.Event()
    real_step = finite_mod.apply_outer_step

    def paused_step(*args: Any, on_piece: Any = None, **kwargs: Any) -> None:
        def report(param: torch.Tensor, elements: int) -> None:
            on_piece(param, elements)
            if not first_done.is_set():  # hold the step once the first tensor is final
                first_done.set()
                assert release.wait(TIMEOUT)

        real_step(*args, on_piece=report if on_piece is not None else None, **kwargs)

    monkeypatch.setattr(finite_mod, "apply_outer_step", paused_step)
    server = make_server(params=params, **EXACT)
    try:
        register(server, "w")
        accept(server, body("w", 0, "w-0", grads))
        assert first_done.wait(TIMEOUT)
        resp = requests.get(
            url(server, "/global_params?min_round=1&worker_id=w"), stream=True, timeout=TIMEOUT
        )
        assert resp.status_code == 200

        def read(count: int) -> bytes:
            out = b""
            while len(out) < count:
                part = resp.raw.read(count - len(out))
                assert part, "body ended early"
                out += part
            return out

        prefix = read(8)
        header = read(struct.unpack("<Q", prefix)[0])
        meta = json.loads(header)["__metadata__"]
        first = read(DOWNLOAD_CHUNK)
        # Round 1 is not published yet (the step is held), yet the start of its first tensor
        # has arrived, with its final values.
        assert meta["round"] == "1" and status(server)["round"] == 0
        want = expected_exact(params, grads)
        got = torch.frombuffer(bytearray(first), dtype=torch.float32)
        assert torch.equal(got, want["a"][: got.numel()])
        release.set()
        rest = resp.raw.read()
        tensors = safetensors.torch.load(prefix + header + first + rest)
        assert_params_equal(tensors, want)
        assert wait_round(server, 1)["round"] == 1
    finally:
        release.set()


@pytest.mark.parametrize(
    ("wmem_max", "allowed"), [(None, False), (212992, False), (4 << 20, True), (64 << 20, True)]
)
def test_send_buffer_is_set_only_where_the_system_grants_it_in_full(
    wmem_max: int | None, allowed: bool
) -> None:
    from diloco.server.server import send_buffer_allowed

    assert send_buffer_allowed(wmem_max) is allowed


def test_connections_inherit_the_send_buffer_where_allowed(make_server: ServerFactory) -> None:
    from diloco.server import server as server_mod

    if not server_mod.send_buffer_allowed(server_mod._wmem_max()):
        pytest.skip("net.core.wmem_max is below SEND_BUFFER_BYTES here: autotuning is left on")
    srv = make_server()
    (site,) = srv._runner.sites  # type: ignore[union-attr]
    listener = site._server.sockets[0]  # type: ignore[attr-defined]
    # Linux doubles the request for its bookkeeping; accepted sockets copy the listener's.
    assert (
        listener.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) == 2 * server_mod.SEND_BUFFER_BYTES
    )
