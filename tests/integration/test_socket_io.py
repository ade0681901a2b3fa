"""Tensor bodies on plain connections.

Uploads that ask ``Expect: 100-continue`` are received straight from the socket
(server/web/socket_body.py): the same results and the same refusals as the ordinary path, a reply
the client can always read, and a connection that ends with it. Downloads, large or small,
arrive whole on a connection that stays usable."""

from __future__ import annotations

import http.client
import json
import socket
from typing import Any

import pytest
import safetensors.torch
import torch

from diloco.server.config import ServerConfig
from diloco.server.server import DiLoCoServer
from diloco.wire import encode
from tests.helpers.http import (
    EXACT,
    TIMEOUT,
    accept,
    assert_params_equal,
    assert_unchanged,
    body,
    expected_exact,
    finish_round0,
    pseudo_grad,
    register,
    state,
    status,
    wait_round,
)
from tests.helpers.servers import ServerFactory, initial_params

CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


class RawUpload:
    """One POST on its own socket, driven step by step."""

    def __init__(
        self, server: DiLoCoServer, length: int, *, expect: bool = True, path: str = ""
    ) -> None:
        self.sock = socket.create_connection(("127.0.0.1", server.port), timeout=TIMEOUT)
        head = (
            f"POST {path or '/submit_pseudograd'} HTTP/1.1\r\nHost: {server.address}\r\n"
            "Content-Type: application/octet-stream\r\nX-Diloco-Client: test\r\n"
            f"Content-Length: {length}\r\n"
            + ("Expect: 100-continue\r\n" if expect else "")
            + "\r\n"
        )
        self.sock.sendall(head.encode())

    def interim(self) -> bytes:
        got = b""
        while len(got) < len(CONTINUE):
            part = self.sock.recv(len(CONTINUE) - len(got))
            if not part:
                break
            got += part
        return got

    def reply(self) -> tuple[int, dict[str, Any], http.client.HTTPResponse]:
        resp = http.client.HTTPResponse(self.sock)
        resp.begin()
        return resp.status, json.loads(resp.read()), resp

    def closed_by_server(self) -> bool:
        return self.sock.recv(1) == b""

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def two_workers(make_server: ServerFactory) -> DiLoCoServer:
    server = make_server(num_workers=2, **EXACT)
    register(server, "a")
    register(server, "b")
    return server


def test_an_upload_from_the_socket_counts_like_any_other(two_workers: DiLoCoServer) -> None:
    server = two_workers
    data = body("a", 0, "a-0", seed=1)
    up = RawUpload(server, len(data))
    try:
        assert up.interim() == CONTINUE  # the handler answers it, having paused the transport
        up.sock.sendall(data)
        code, reply, resp = up.reply()
        assert code == 200 and reply["status"] == "accepted"
        assert resp.getheader("Connection") == "close"  # aiohttp's parser never saw the body
        assert up.closed_by_server()
    finally:
        up.close()
    assert status(server)["bytes_in"] == len(data)
    finish_round0(server, initial_params())


def test_without_expect_the_ordinary_path_keeps_the_connection(
    two_workers: DiLoCoServer,
) -> None:
    server = two_workers
    data = body("a", 0, "a-0", seed=1)
    up = RawUpload(server, len(data), expect=False)
    try:
        up.sock.sendall(data)
        code, reply, resp = up.reply()
        assert code == 200 and reply["status"] == "accepted"
        assert resp.getheader("Connection") != "close"
    finally:
        up.close()
    finish_round0(server, initial_params())


def test_a_refusal_after_the_header_reaches_the_client(two_workers: DiLoCoServer) -> None:
    """409 once the header is read, with the payload still in the socket: the rest is read
    away before the socket closes, so the client finishes sending and reads its reply."""
    server = two_workers
    before = state(server)
    big = {"w": torch.zeros(3, 4), "b": torch.zeros(4)}
    data = body("a", 3, "a-3", big)  # a future round
    up = RawUpload(server, len(data))
    try:
        assert up.interim() == CONTINUE
        up.sock.sendall(data)
        code, reply, _ = up.reply()
        assert code == 409 and reply["error"] == "future_round" and reply["action"] == "rebase"
        assert up.closed_by_server()
    finally:
        up.close()
    assert_unchanged(before, server)
    accept(server, body("a", 0, "a-0", seed=1))  # the same id, now whole and in time
    finish_round0(server, initial_params())


@pytest.mark.parametrize(
    ("extra", "code"), [(b"junk", "trailing_bytes"), (None, "truncated")], ids=["long", "short"]
)
def test_a_body_that_does_not_match_its_length_changes_nothing(
    two_workers: DiLoCoServer, extra: bytes | None, code: str
) -> None:
    server = two_workers
    before = state(server)
    data = body("a", 0, "a-0", seed=1)
    sent = data + extra if extra is not None else data[:-6]
    # Declared: what is sent plus what is missing, or what is sent including the junk.
    up = RawUpload(server, len(sent) if extra is not None else len(data))
    try:
        assert up.interim() == CONTINUE
        up.sock.sendall(sent)
        if extra is None:
            up.sock.shutdown(socket.SHUT_WR)  # the client gives up on the rest
        status_code, reply, _ = up.reply()
        assert status_code == 400 and reply["error"] == code, reply
    finally:
        up.close()
    assert_unchanged(before, server)
    accept(server, body("a", 0, "a-0", seed=1))  # the same id, now whole and in time
    finish_round0(server, initial_params())


def test_a_refusal_before_the_body_is_sent_needs_no_body(make_server: ServerFactory) -> None:
    """Wrong token: the answer comes instead of 100 Continue; nothing of the body is owed."""
    server = make_server(num_workers=1, token="secret-token-123")
    up = RawUpload(server, 10_000)
    try:
        code, reply, _ = up.reply()
        assert code == 401 and reply["error"] == "unauthorized"
    finally:
        up.close()


def test_initial_parameters_from_the_socket() -> None:
    server = DiLoCoServer(ServerConfig(port=0, num_workers=1)).start()
    try:
        register(server, "a")
        data = encode(initial_params())
        up = RawUpload(server, len(data), path="/initial_params?worker_id=a")
        try:
            assert up.interim() == CONTINUE
            up.sock.sendall(data)
            code, reply, resp = up.reply()
            assert code == 200, reply
            assert resp.getheader("Connection") == "close"
        finally:
            up.close()
        assert_params_equal(server.global_params(), initial_params())
    finally:
        server.stop()


def test_a_retry_after_a_refusal_counts_once(two_workers: DiLoCoServer) -> None:
    server = two_workers
    poisoned = pseudo_grad(1)
    poisoned["b"] = poisoned["b"].clone()
    poisoned["b"][0] = float("nan")
    bad = body("a", 0, "a-0", poisoned)
    up = RawUpload(server, len(bad))
    try:
        assert up.interim() == CONTINUE
        up.sock.sendall(bad)
        code, reply, _ = up.reply()
        assert code == 422 and reply["error"] == "non_finite"
    finally:
        up.close()
    accept(server, body("a", 0, "a-0", seed=1))
    accept(server, body("b", 0, "b-0", seed=2))
    wait_round(server, 1)
    assert_params_equal(
        server.global_params(), expected_exact(initial_params(), pseudo_grad(1), pseudo_grad(2))
    )


def test_downloads_from_the_socket_keep_the_connection(two_workers: DiLoCoServer) -> None:
    server = two_workers
    want = initial_params()
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=TIMEOUT)
    try:
        conn.connect()
        first = conn.sock
        conn.auto_open = 0  # fail instead of reconnecting: the same connection must carry all
        for _ in range(2):
            conn.request("GET", "/global_params?worker_id=a", headers={"X-Diloco-Client": "t"})
            resp = conn.getresponse()
            assert resp.status == 200 and resp.getheader("Connection") != "close"
            got = safetensors.torch.load(resp.read())
            assert_params_equal(got, want)
        conn.request("GET", "/status")
        resp = conn.getresponse()
        assert resp.status == 200 and json.loads(resp.read())["round"] == 0
        assert conn.sock is first
    finally:
        conn.close()


def test_a_download_larger_than_the_socket_buffers_arrives_whole(
    make_server: ServerFactory,
) -> None:
    """16 MB: the sends fill the socket and wait for the reader, again and again."""
    big = {"w": torch.randn(4_000_000, generator=torch.Generator().manual_seed(7))}
    server = make_server(params=big, num_workers=1)
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=TIMEOUT)
    try:
        conn.request("GET", "/global_params", headers={"X-Diloco-Client": "t"})
        resp = conn.getresponse()
        assert resp.status == 200
        parts = []
        while part := resp.read(64 * 1024):  # a slow reader, by the server's standards
            parts.append(part)
        assert_params_equal(safetensors.torch.load(b"".join(parts)), big)
    finally:
        conn.close()
