"""The worker's bulk connections (http.client): downloads with readinto (keep-alive reuse,
recovery from a connection the server closed while idle, replies that are not a parameter body)
and the wait for ``100 Continue`` before an upload's body.

A small HTTP/1.1 server in a thread plays the diloco server; it records the client port of every
request, so a test sees whether a connection was reused."""

from __future__ import annotations

import http.server
import json
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import torch

from diloco.wire import Layout, WireError, byte_view, encode, tensor_views
from diloco.worker.transport.bulk import BulkConnections, Continue, _await_continue
from diloco.worker.transport.client import DiLoCoClient, Download, ServerError, UnknownWorker


@dataclass
class Script:
    """What the stub answers, one entry per request (the last one repeats)."""

    replies: list[tuple[int, str, bytes]]
    close_after: set[int] = field(default_factory=set)  # close silently after these requests
    ports: list[int] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)


def _handler(script: Script) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive unless a side closes
        disable_nagle_algorithm = True  # headers and body are two writes, as in aiohttp

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            index = len(script.ports)
            script.ports.append(self.client_address[1])
            script.paths.append(self.path)
            script.headers.append(dict(self.headers))
            status, ctype, body = script.replies[min(index, len(script.replies) - 1)]
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            self.wfile.flush()
            if index in script.close_after:
                self.close_connection = True  # no "Connection: close": an idle timeout

        def log_message(self, *args: object) -> None:
            pass

    return Handler


@pytest.fixture
def stub() -> Iterator[tuple[Script, str]]:
    script = Script(replies=[])
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler(script))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True)
    thread.start()
    try:
        yield script, f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


TENSORS = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(3)}
BODY = encode(TENSORS, {"round": "4", "instance": "abc"})
OCTETS = "application/octet-stream"


def _download(client: DiLoCoClient) -> tuple[Download, dict[str, torch.Tensor]] | None:
    holder: dict[str, torch.Tensor] = {}

    def into(layout: Layout) -> memoryview:
        holder["payload"] = torch.empty(layout.payload_size, dtype=torch.uint8)
        return byte_view(holder["payload"])

    got = client.download(into, min_round=3, worker_id="w1")
    if got is None:
        return None
    return got, tensor_views(got.layout, holder["payload"])


def _client(address: str, retries: int = 1) -> DiLoCoClient:
    return DiLoCoClient(address, retries=retries, backoff=0.01, token="secret")


def test_downloads_land_in_place_and_reuse_one_connection(stub: tuple[Script, str]) -> None:
    script, address = stub
    script.replies = [(200, OCTETS, BODY)]
    client = _client(address)
    for _ in range(3):
        result = _download(client)
        assert result is not None
        got, tensors = result
        assert got.round == 4 and got.instance == "abc"
        for name, want in TENSORS.items():
            torch.testing.assert_close(tensors[name], want, rtol=0, atol=0)
    assert len(set(script.ports)) == 1, "each download opened its own connection"
    assert script.paths[0].startswith("/global_params?")
    assert "min_round=3" in script.paths[0] and "worker_id=w1" in script.paths[0]
    sent = {k.lower(): v for k, v in script.headers[0].items()}
    assert sent["authorization"] == "Bearer secret" and sent["x-diloco-client"] == "worker"
    assert client.bytes_down == 3 * len(BODY) and client.retry_count == 0
    client.close()


def test_a_connection_closed_while_idle_is_replaced_without_a_retry(
    stub: tuple[Script, str],
) -> None:
    script, address = stub
    script.replies = [(200, OCTETS, BODY)]
    script.close_after = {0}
    client = _client(address)
    assert _download(client) is not None
    assert _download(client) is not None
    assert len(set(script.ports)) == 2  # a fresh connection for the second download
    assert client.retry_count == 0
    client.close()


def test_pending_and_error_replies(stub: tuple[Script, str]) -> None:
    script, address = stub
    pending = json.dumps({"status": "pending", "round": 2}).encode()
    gone = json.dumps({"error": "unknown_worker", "detail": "register again"}).encode()
    script.replies = [
        (202, "application/json", pending),
        (410, "application/json", gone),
        (500, "text/plain", b"not json at all"),
        (200, OCTETS, BODY),
    ]
    client = _client(address, retries=0)
    assert _download(client) is None  # the long poll ended first
    with pytest.raises(UnknownWorker):
        _download(client)
    with pytest.raises(ServerError) as exc:
        _download(client)
    assert exc.value.status == 500 and exc.value.code == "bad_reply"
    assert _download(client) is not None
    assert len(set(script.ports)) == 1  # small replies read to the end keep the connection
    client.close()


def test_trailing_bytes_are_refused_and_the_connection_dropped(stub: tuple[Script, str]) -> None:
    script, address = stub
    script.replies = [(200, OCTETS, BODY + b"extra"), (200, OCTETS, BODY)]
    client = _client(address)
    with pytest.raises(WireError) as exc:
        _download(client)
    assert exc.value.code == "trailing_bytes"
    assert _download(client) is not None
    assert len(set(script.ports)) == 2  # the half-read connection was not reused
    client.close()


def test_a_short_body_is_truncated_and_retried(stub: tuple[Script, str]) -> None:
    script, address = stub
    # The Content-Length says the body is shorter than its own header announces.
    script.replies = [(200, OCTETS, BODY[:-4]), (200, OCTETS, BODY)]
    client = _client(address)
    assert _download(client) is not None
    assert client.retry_count == 1
    client.close()


def test_addresses_are_checked_up_front() -> None:
    with pytest.raises(ValueError):
        BulkConnections(
            "ftp://example.org",
            headers={},
            connect_timeout=1.0,
            read_timeout=1.0,
            verify=True,
        )


# --- uploads: Expect: 100-continue ------------------------------------------------------------


def _pair() -> tuple[socket.socket, socket.socket]:
    client, server = socket.socketpair()
    client.settimeout(5)
    server.settimeout(5)
    return client, server


def test_100_continue_is_read_off_and_the_body_may_go() -> None:
    client, server = _pair()
    with client, server:
        server.sendall(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200")
        assert _await_continue(client, wait=5) is Continue.GRANTED
        assert client.recv(100) == b"HTTP/1.1 200"  # the interim answer alone was consumed


def test_a_final_answer_first_keeps_the_body_and_stays_for_getresponse() -> None:
    client, server = _pair()
    with client, server:
        answer = b"HTTP/1.1 401 Unauthorized\r\nContent-Length: 0\r\n\r\n"
        server.sendall(answer)
        assert _await_continue(client, wait=5) is Continue.ANSWERED
        assert client.recv(100) == answer


def test_an_interim_answer_split_across_segments_is_awaited_whole() -> None:
    client, server = _pair()
    with client, server:
        server.sendall(b"HTTP/1.1 100 Cont")

        def rest() -> None:
            server.sendall(b"inue\r\n\r\n")

        timer = threading.Timer(0.05, rest)
        timer.start()
        try:
            assert _await_continue(client, wait=5) is Continue.GRANTED
        finally:
            timer.join()
        server.sendall(b"x")
        assert client.recv(10) == b"x"


def test_silence_means_send_anyway() -> None:
    client, server = _pair()
    with client, server:
        assert _await_continue(client, wait=0.05) is Continue.SILENT  # Expect ignored


def test_a_closed_connection_is_left_to_getresponse() -> None:
    client, server = _pair()
    with client:
        server.close()
        assert _await_continue(client, wait=5) is Continue.ANSWERED


def test_a_late_100_does_not_stop_a_body_already_on_its_way(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The client waited in vain and sends; the 100 then arrives mid-body. That is no early
    final answer: the body must go on, or both sides wait for each other."""
    from diloco.worker.transport import bulk

    monkeypatch.setattr(bulk, "CONTINUE_WAIT", 0.01)
    size = 32 * 1024 * 1024  # more than the socket buffers: the 100 lands mid-body
    listener = socket.create_server(("127.0.0.1", 0))
    got = {}

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            head = b""
            while b"\r\n\r\n" not in head:
                head += conn.recv(65536)
            received = len(head.split(b"\r\n\r\n", 1)[1])
            while not received:  # the 100 goes only once the body has started
                received += len(conn.recv(65536))
            conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
            while received < size:
                part = conn.recv(1 << 20)
                if not part:
                    break
                received += len(part)
            got["received"] = received
            reply = b'{"status": "ok"}'
            conn.sendall(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(reply)}\r\n\r\n".encode()
                + reply
            )

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    conns = BulkConnections(
        f"http://127.0.0.1:{listener.getsockname()[1]}",
        headers={},
        connect_timeout=5,
        read_timeout=10,
        verify=True,
    )
    try:
        piece = memoryview(bytes(1 << 20))
        status, raw = conns.post("/up", {}, size, [piece] * 32, 1 << 20)
    finally:
        conns.close()
        listener.close()
    thread.join(10)
    assert status == 200 and json.loads(raw) == {"status": "ok"}
    assert got["received"] == size


def test_descriptors_above_1023_are_watched_too() -> None:
    """select() refuses them; a training process with many open files can hand them out."""
    import os
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    high = 2000
    if hard != resource.RLIM_INFINITY and hard <= high:
        pytest.skip(f"the hard limit on open files ({hard}) is too low for this test")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, high + 1), hard))
    client, server = _pair()
    try:
        os.dup2(client.fileno(), high)
        far = socket.socket(fileno=high)
        with far, server:
            server.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
            assert _await_continue(far, wait=5) is Continue.GRANTED
    finally:
        client.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
