"""Tensor bodies over plain keep-alive ``http.client`` connections, one per thread.

Downloads: requests (urllib3) hands a streamed body out as fresh ``bytes`` objects that the
caller then copies into its own memory; ``http.client``'s ``readinto`` lets the socket write the
payload straight into the destination tensor. For a 400 MB model that is one user-space copy of
every downloaded byte fewer, on every worker, every round (see docs/benchmarks-log.md).

Uploads: on plain HTTP they ask ``Expect: 100-continue`` and send the body once the server says
``100 Continue``, which lets the server receive it straight into its buffer
(server/web/socket_body.py); a refusal that comes first (401, 413, 503) costs no body at all.
urllib3 cannot wait for the interim answer, so uploads go this way too. JSON calls stay on
requests.

The connection settings mirror the requests session's: the same headers, no proxy, certificate
checks against the same roots (``verify`` is requests' argument: True, False or a CA path), a
connect timeout while connecting and the read timeout on every receive afterwards.
"""

from __future__ import annotations

import enum
import http.client
import os
import select
import socket
import ssl
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import urlencode, urlsplit

import requests.certs


def ssl_context(verify: bool | str) -> ssl.SSLContext:
    if verify is False:
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        return ctx
    where = verify if isinstance(verify, str) else requests.certs.where()
    if os.path.isdir(where):
        return ssl.create_default_context(capath=where)
    return ssl.create_default_context(cafile=where)


def _tune(sock: socket.socket, read_timeout: float) -> None:
    # No Nagle delay on small writes (urllib3 sets the same); then the read timeout per receive.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.settimeout(read_timeout)


class _HTTP(http.client.HTTPConnection):
    read_timeout: float

    def connect(self) -> None:
        super().connect()  # under the connect timeout given at construction
        _tune(self.sock, self.read_timeout)


class _HTTPS(http.client.HTTPSConnection):
    read_timeout: float

    def connect(self) -> None:
        super().connect()  # TCP connect and TLS handshake under the connect timeout
        _tune(self.sock, self.read_timeout)


def _readable(sock: socket.socket, timeout: float) -> bool:
    """Whether ``sock`` has something to read (or was closed) within ``timeout`` seconds.
    poll, not select: select refuses descriptors above 1023, which a training process with many
    open files can hand out."""
    if hasattr(select, "poll"):
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        return bool(poller.poll(max(0, int(timeout * 1000))))
    readable, _, _ = select.select([sock], [], [], timeout)
    return bool(readable)


CONTINUE_WAIT = 1.0
"""Longest an upload waits for ``100 Continue`` before it sends its body anyway (as curl does):
a proxy or another server may never answer the ``Expect``."""

INTERIM_LIMIT = 8192  # bytes of an interim answer's head looked at, at most


class Continue(enum.Enum):
    """What came back after ``Expect: 100-continue``."""

    GRANTED = "100 Continue came and was read off the socket: send the body"
    SILENT = "nothing came in time: send the body anyway"
    ANSWERED = "a final answer came first (left in the socket): send no body"


def _await_continue(sock: socket.socket, wait: float) -> Continue:
    """Wait up to ``wait`` seconds for the server's answer to ``Expect: 100-continue``. An
    interim answer is consumed; a final one stays for http.client's ``getresponse``."""
    deadline = time.monotonic() + wait
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return Continue.SILENT
        if not _readable(sock, left):
            return Continue.SILENT
        head = sock.recv(INTERIM_LIMIT, socket.MSG_PEEK)
        if not head:
            return Continue.ANSWERED  # closed: getresponse() reports it
        if len(head) >= 12 and not (head.startswith(b"HTTP/1.") and head[9:12] == b"100"):
            return Continue.ANSWERED
        end = head.find(b"\r\n\r\n")
        if end >= 0:
            sock.recv(end + 4)  # the interim answer, whole (it was already in the buffer)
            return Continue.GRANTED
        if len(head) >= INTERIM_LIMIT:
            raise http.client.HTTPException("an interim answer with an over-long head")
        time.sleep(0.001)  # the head is split across segments: wait for its rest


def _answered(sock: socket.socket) -> bool:
    """The server has sent something while the body is still going out: its final answer,
    given before it read the whole body (a refusal). Sending on would be wasted."""
    return _readable(sock, 0)


def _dropped(conn: http.client.HTTPConnection) -> bool:
    """An idle keep-alive connection with something to read has been closed by the server (or
    holds bytes nobody asked for): either way it cannot carry the next request."""
    sock = conn.sock
    if sock is None:
        return False
    try:
        return _readable(sock, 0)
    except (OSError, ValueError):
        return True


class BulkConnections:
    """One keep-alive connection per calling thread to the server at ``base_url``."""

    def __init__(
        self,
        base_url: str,
        *,
        headers: Mapping[str, str],
        connect_timeout: float,
        read_timeout: float,
        verify: bool | str,
    ) -> None:
        split = urlsplit(base_url)
        if split.scheme not in ("http", "https") or not split.hostname:
            raise ValueError(f"not an http(s) server address: {base_url!r}")
        self._https = split.scheme == "https"
        self._host = split.hostname
        self._port = split.port
        self._prefix = split.path.rstrip("/")
        self._headers = dict(headers)
        self._connect_timeout = connect_timeout
        self._read_timeout = read_timeout
        self._context = ssl_context(verify) if self._https else None
        self._local = threading.local()
        self._lock = threading.Lock()
        self._all: list[http.client.HTTPConnection] = []

    def _connection(self) -> http.client.HTTPConnection:
        conn: http.client.HTTPConnection | None = getattr(self._local, "conn", None)
        if conn is not None and _dropped(conn):
            conn.close()  # http.client reconnects on the next request
        if conn is None:
            fresh: _HTTP | _HTTPS
            if self._https:
                fresh = _HTTPS(
                    self._host, self._port, timeout=self._connect_timeout, context=self._context
                )
            else:
                fresh = _HTTP(self._host, self._port, timeout=self._connect_timeout)
            fresh.read_timeout = self._read_timeout
            self._local.conn = conn = fresh
            with self._lock:
                self._all.append(conn)
        return conn

    def _target(self, path: str, params: Mapping[str, Any]) -> str:
        return self._prefix + path + ("?" + urlencode(params) if params else "")

    def get(self, path: str, params: Mapping[str, Any]) -> http.client.HTTPResponse:
        """Send ``GET path?params`` and return the response with its body unread. Whoever
        reads it calls ``discard()`` if it stops before the end of the body."""
        target = self._target(path, params)
        conn = self._connection()
        reused = conn.sock is not None
        try:
            try:
                conn.request("GET", target, headers=self._headers)
                return conn.getresponse()
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                if not reused:
                    raise
                # The server closed the idle connection as the request went out (its keep-alive
                # timeout): a GET is safe to send again at once, on a fresh connection.
                conn.close()
                conn.request("GET", target, headers=self._headers)
                return conn.getresponse()
        except BaseException:
            self.discard()
            raise

    def post(
        self,
        path: str,
        params: Mapping[str, Any],
        size: int,
        chunks: Iterable[memoryview | bytes],
        limit: int,
    ) -> tuple[int, bytes]:
        """POST a body of ``size`` bytes sent chunk by chunk from the chunks' own memory.
        Returns the reply's status and at most ``limit`` bytes of its body."""
        target = self._target(path, params)
        conn = self._connection()
        keep = False
        try:
            conn.putrequest("POST", target, skip_accept_encoding=True)
            for name, value in self._headers.items():
                conn.putheader(name, value)
            conn.putheader("Content-Type", "application/octet-stream")
            conn.putheader("Content-Length", str(size))
            expect = not self._https  # the server reads TLS bodies the ordinary way anyway
            if expect:
                conn.putheader("Expect", "100-continue")
            conn.endheaders()
            reply = _await_continue(conn.sock, CONTINUE_WAIT) if expect else Continue.SILENT
            sent = reply is not Continue.ANSWERED
            if sent:
                for chunk in chunks:
                    # Anything readable after the 100 is the final answer, given early. Not
                    # without the 100 (a late 100 may still come) nor on TLS (a readable socket
                    # can be a record with no answer in it, such as a session ticket).
                    if reply is Continue.GRANTED and _answered(conn.sock):
                        sent = False
                        break
                    conn.send(chunk)
            resp = conn.getresponse()
            raw = resp.read(limit)
            # Unsent (or cut short), the body the request announced is owed on this connection.
            keep = sent and resp.isclosed()
            return resp.status, raw
        finally:
            if not keep:
                self.discard()

    def discard(self) -> None:
        """Close this thread's connection: its state is unknown after an error."""
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()

    def close(self) -> None:
        with self._lock:
            conns = list(self._all)
        for conn in conns:
            conn.close()
