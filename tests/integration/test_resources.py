"""Bounded resources before authentication, against a real server on loopback: the deadline
for request heads, the connection caps that spare token holders, and the minimum upload rate
(issue 15, findings 5 and 6; finding 7 is in test_security.py)."""

from __future__ import annotations

import http.client
import json
import select
import socket
import threading
import time
from typing import Any

import pytest
import requests

from diloco.server.server import DiLoCoServer
from tests.helpers.http import AUTH, CLIENT, TIMEOUT, TOKEN, accept, body, register, status, url
from tests.helpers.servers import ServerFactory

WAIT = 3.0  # longest any step below waits for the server; each deadline here is far shorter
HEAD = b"GET /status HTTP/1.1\r\nHost: 127.0.0.1\r\n"  # a request head without its blank line


def connect(server: DiLoCoServer) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=WAIT)


def closed_by_server(sock: socket.socket) -> bool:
    """Whether the server closes ``sock`` within ``WAIT`` (False: it is still open then)."""
    sock.settimeout(WAIT)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def wait_until(check: Any, what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


# --- the header deadline -------------------------------------------------------------------------


def test_half_sent_heads_and_idle_connections_are_closed_after_the_header_deadline(
    make_server: ServerFactory,
) -> None:
    server = make_server(token=TOKEN, header_timeout=0.3)
    start = time.monotonic()
    half = [connect(server) for _ in range(40)]
    for sock in half:
        sock.sendall(HEAD)
    silent = connect(server)
    kept_alive = http.client.HTTPConnection("127.0.0.1", server.port, timeout=WAIT)
    kept_alive.request("GET", "/status", headers=AUTH)
    assert kept_alive.getresponse().read() and kept_alive.sock is not None
    try:
        for sock in [*half, silent, kept_alive.sock]:
            assert closed_by_server(sock)
        assert time.monotonic() - start >= 0.3
        # Trickling the head does not help: the deadline runs from the connection's start.
        with connect(server) as trickle:
            start = time.monotonic()
            for byte in HEAD:
                try:
                    trickle.sendall(bytes([byte]))
                except (BrokenPipeError, ConnectionResetError):
                    break
                if select.select([trickle], [], [], 0.05)[0]:
                    break
            assert closed_by_server(trickle)
            assert 0.3 <= time.monotonic() - start < WAIT
    finally:
        for sock in half:
            sock.close()
        silent.close()
        kept_alive.close()
    # Meanwhile the server kept serving.
    assert requests.get(url(server, "/status"), headers=AUTH, timeout=TIMEOUT).status_code == 200


# --- connection caps -----------------------------------------------------------------------------


def test_one_address_keeps_at_most_its_share_of_connections_without_a_token(
    make_server: ServerFactory,
) -> None:
    """Connections without a token past the per-address cap close the oldest such: the
    attacker's sockets churn while a worker's connection, and new ones, are served."""
    server = make_server(token=TOKEN, max_connections_per_ip=4)
    worker = http.client.HTTPConnection("127.0.0.1", server.port, timeout=WAIT)
    worker.request("GET", "/status", headers=AUTH)
    assert worker.getresponse().read()
    first = [connect(server) for _ in range(4)]  # accepted in order: these are the oldest
    later = [connect(server) for _ in range(4)]
    try:
        for sock in first:
            assert closed_by_server(sock)
        table = server.connections
        assert table is not None
        wait_until(lambda: table.closed_unproven == 4, "the oldest were not closed")
        assert table.open == 5  # the worker and the four latest
        # The worker's connection, proven by its token, was never a candidate.
        worker.request("GET", "/status", headers=AUTH)
        assert worker.getresponse().status == 200
        # A new connection from the same address, with the token, gets in too.
        assert requests.get(url(server, "/status"), headers=AUTH, timeout=TIMEOUT).ok
    finally:
        for sock in first + later:
            sock.close()
        worker.close()


def test_when_every_connection_carries_the_token_a_new_one_gets_503(
    make_server: ServerFactory,
) -> None:
    server = make_server(token=TOKEN, max_connections=2)
    workers = [http.client.HTTPConnection("127.0.0.1", server.port, timeout=WAIT) for _ in "ab"]
    try:
        for worker in workers:
            worker.request("GET", "/status", headers=AUTH)
            assert worker.getresponse().read()
        with connect(server) as extra:
            extra.sendall(HEAD + f"Authorization: Bearer {TOKEN}\r\n\r\n".encode())
            reply = http.client.HTTPResponse(extra)
            reply.begin()
            assert reply.status == 503 and reply.getheader("Retry-After") == "1"
            assert json.loads(reply.read())["error"] == "too_many_connections"
        table = server.connections
        assert table is not None and table.refused == 1
        workers[0].close()
        wait_until(lambda: table.open == 1, "a closed connection still counts")
        assert requests.get(url(server, "/status"), headers=AUTH, timeout=TIMEOUT).ok
    finally:
        for worker in workers:
            worker.close()


# --- the minimum upload rate ---------------------------------------------------------------------


class Trickle(threading.Thread):
    """An upload that sends its tensor header at once, then one byte every 50 ms (20 B/s)."""

    def __init__(self, server: DiLoCoServer, data: bytes, *, expect: bool) -> None:
        super().__init__(daemon=True)
        self.sock = connect(server)
        self.data = data
        self.expect = expect
        self.head = (
            f"POST /submit_pseudograd HTTP/1.1\r\nHost: {server.address}\r\n"
            "Content-Type: application/octet-stream\r\nX-Diloco-Client: test\r\n"
            f"Authorization: Bearer {TOKEN}\r\nContent-Length: {len(data)}\r\n"
            + ("Expect: 100-continue\r\n" if expect else "")
            + "\r\n"
        ).encode()
        self.reply: tuple[int, dict[str, Any]] | None = None
        self.started = threading.Event()  # the tensor header is sent

    def run(self) -> None:
        with self.sock:
            self.sock.sendall(self.head)
            if self.expect:
                assert self.sock.recv(100).startswith(b"HTTP/1.1 100")
            cut = len(self.data) - 60  # the tensor header and a few payload bytes
            self.sock.sendall(self.data[:cut])
            self.started.set()
            for byte in self.data[cut:]:
                if select.select([self.sock], [], [], 0.05)[0]:
                    break  # the server answered
                self.sock.sendall(bytes([byte]))
            reply = http.client.HTTPResponse(self.sock)
            reply.begin()
            self.reply = reply.status, json.loads(reply.read())


@pytest.mark.parametrize("expect", [True, False], ids=["from-socket", "aiohttp-stream"])
def test_uploads_that_crawl_are_dropped_and_free_the_buffer(
    make_server: ServerFactory, expect: bool
) -> None:
    """Finding 6: two uploads trickling a byte at a time held a third worker's upload without
    end. Each is now dropped (408 too_slow) after one rate window of waiting for it, so the third
    waits about two windows (here 0.3 s each; 10 s each with the defaults, where it waited over
    45 s before)."""
    server = make_server(num_workers=3, token=TOKEN, min_upload_rate=1000, upload_rate_window=0.3)
    for worker in "abc":
        register(server, worker, AUTH)
    slow = [
        Trickle(server, body(w, 0, f"{w}-0", seed=i), expect=expect) for i, w in enumerate("ab")
    ]
    slow[0].start()
    wait_until(lambda: status(server)["uploading"] == ["a"], "a never took the buffer")
    slow[1].start()
    assert slow[1].started.wait(WAIT)  # b waits for the buffer (or has it, a dropped already)
    start = time.monotonic()
    reply = accept(server, body("c", 0, "c-0", seed=3), {**AUTH, **CLIENT})
    took = time.monotonic() - start
    for trickle in slow:
        trickle.join(WAIT)
        assert trickle.reply is not None
        code, detail = trickle.reply
        assert (code, detail["error"]) == (408, "too_slow"), detail
    assert reply["status"] == "accepted"
    assert took < 2 * 0.3 + 1.0  # two windows, and slack for a loaded machine
    assert status(server)["submitted"] == ["c"]
