"""Parameter downloads over plain keep-alive ``http.client`` connections, one per thread.

requests (urllib3) hands a streamed body out as fresh ``bytes`` objects that the caller then
copies into its own memory; ``http.client``'s ``readinto`` lets the socket write the payload
straight into the destination tensor. For a 400 MB model that is one user-space copy of every
downloaded byte fewer, on every worker, every round (see docs/benchmarks.md). JSON calls and
uploads stay on requests, which sends tensor memory without copying it already.

The connection settings mirror the requests session's: the same headers, no proxy, certificate
checks against the same roots (``verify`` is requests' argument: True, False or a CA path), a
connect timeout while connecting and the read timeout on every receive afterwards.
"""

from __future__ import annotations

import http.client
import os
import select
import socket
import ssl
import threading
from collections.abc import Mapping
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


def _dropped(conn: http.client.HTTPConnection) -> bool:
    """An idle keep-alive connection with something to read has been closed by the server (or
    holds bytes nobody asked for): either way it cannot carry the next request."""
    sock = conn.sock
    if sock is None:
        return False
    try:
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return True
    return bool(readable)


class DownloadConnections:
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

    def get(self, path: str, params: Mapping[str, Any]) -> http.client.HTTPResponse:
        """Send ``GET path?params`` and return the response with its body unread. Whoever
        reads it calls ``discard()`` if it stops before the end of the body."""
        target = self._prefix + path + ("?" + urlencode(params) if params else "")
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
