"""Bounded connections before authentication.

Every connection costs a file descriptor before anyone knows whether it carries the token, and
a process with more descriptors open than ``ulimit -n`` can no longer ``accept()``: a peer with
no token at all could open connections and hold them (trickling header bytes, or sending
nothing) until the workers' own requests failed. Three bounds stop that:

- **A deadline for the request head.** aiohttp already closes a connection whose handler is
  waiting for the next request once its keep-alive timeout has passed since the connection
  opened or its last reply went out, whether no byte or half a head has arrived meanwhile; so
  the server's ``keepalive_timeout`` is ``header_timeout`` (server.py), and a TLS handshake gets
  as long. A request being handled is not affected: its body has its own bounds (``StallGuard``).
- **A cap on connections, total and per address, that spares token holders.** The listening
  socket's protocol factory is ``Connection``, a thin protocol around each of aiohttp's request
  handlers that registers it in a ``ConnectionTable``. A connection counts as *unproven* until
  a request on it carries a valid token (the security middleware calls ``vouch``). A new
  connection from an address that already has ``max_per_address`` unproven ones closes the
  oldest of those; one past ``max_connections`` in all closes the oldest unproven connection
  anywhere; only when every connection has proven itself is the new one turned away, with a
  503 ``too_many_connections``. So a peer without the token can hold at most its share of
  unproven connections, however it spreads them, and can never take a connection from a worker
  that showed the token, nor keep one of the worker's new connections out. The cap counts only
  what aiohttp serves, after a TLS handshake; handshakes are bounded by the deadline.
- **Logs that cannot flood the disk**: closing and refusing are logged through a
  ``LogLimiter`` (log_limit.py), as are asyncio's own ``accept()`` failures.

``LimitedSite`` is aiohttp's ``TCPSite`` with ``Connection`` as the protocol factory: the one
seam aiohttp leaves for seeing connections before its parser does.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import resource
import ssl
from collections import OrderedDict
from collections.abc import Callable

from aiohttp import web

from diloco.edge.log_limit import LogLimiter

log = logging.getLogger(__name__)

FD_HEADROOM = 256
"""Descriptors left to everything but connections (checkpoint files, the duplicated sockets of
uploads, logs) when ``max_connections`` comes from the open-file limit."""

MAX_DERIVED = 16384
"""Largest ``max_connections`` taken from the open-file limit (which may be unlimited)."""

REFUSAL_LINGER = 1.0
"""Seconds a turned-away connection stays half-open: its request is read and dropped so the
client reads the 503 rather than a reset."""

MAX_REFUSING = 64
"""Turned-away connections lingering at once; past it a new one is closed without a reply."""

_BODY = json.dumps(
    {
        "error": "too_many_connections",
        "detail": "the server holds as many connections as it may; retry shortly",
    }
).encode()
REFUSAL = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
    b"Retry-After: 1\r\nConnection: close\r\nContent-Length: %d\r\n\r\n" % len(_BODY) + _BODY
)


def default_max_connections() -> int:
    """The soft open-file limit less ``FD_HEADROOM`` (at least 16, at most ``MAX_DERIVED``)."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = MAX_DERIVED + FD_HEADROOM
    return max(16, min(MAX_DERIVED, soft - FD_HEADROOM))


def address_key(host: str | None) -> str:
    """The unit an address-based limit counts: an IPv4 address, or an IPv6 /64 (one machine's
    share of a network, as a single host can use any address in it)."""
    if not host:
        return "?"
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


class ConnectionTable:
    """The connections of one server: how many are open, which are still unproven, by address."""

    def __init__(
        self, max_connections: int, max_per_address: int, limiter: LogLimiter | None = None
    ) -> None:
        self.max_connections = max_connections
        self.max_per_address = max_per_address
        self.limiter = limiter or LogLimiter()
        self.open = 0
        self.closed_unproven = 0  # closed to make room
        self.refused = 0  # turned away with a 503
        self._unproven: OrderedDict[Connection, None] = OrderedDict()  # oldest first
        self._by_address: dict[str, OrderedDict[Connection, None]] = {}
        self._refusing: set[Connection] = set()

    def admit(self, conn: Connection) -> bool:
        """Count ``conn`` as open and unproven, making room if needed; False: turn it away."""
        mine = self._by_address.get(conn.address)
        if mine is not None and len(mine) >= self.max_per_address:
            self._make_room(next(iter(mine)), f"{len(mine)} connections without a token from")
        elif self.open >= self.max_connections:
            if not self._unproven:
                self.refused += 1
                self.limiter.log(
                    log,
                    logging.WARNING,
                    "refused",
                    "turned away a connection from %s: all %d connections carry the token",
                    conn.address,
                    self.open,
                )
                return False
            self._make_room(next(iter(self._unproven)), f"{self.open} connections, oldest from")
        self.open += 1
        conn.counted = True
        self._unproven[conn] = None
        self._by_address.setdefault(conn.address, OrderedDict())[conn] = None
        return True

    def _make_room(self, oldest: Connection, why: str) -> None:
        self.closed_unproven += 1
        self.limiter.log(
            log,
            logging.WARNING,
            "closed",
            "%s %s: closed the oldest that has not shown a token, to make room",
            why,
            oldest.address,
        )
        self.release(oldest)
        assert oldest.transport is not None
        oldest.transport.abort()  # at once: its descriptor is what the new connection needs

    def prove(self, conn: Connection) -> None:
        self._forget(conn)

    def release(self, conn: Connection) -> None:
        """``conn`` is closed (or closing): it no longer counts."""
        self._refusing.discard(conn)
        if conn.counted:
            conn.counted = False
            self.open -= 1
            self._forget(conn)

    def _forget(self, conn: Connection) -> None:
        if conn in self._unproven:
            del self._unproven[conn]
            mine = self._by_address[conn.address]
            del mine[conn]
            if not mine:
                del self._by_address[conn.address]

    def refuse(self, conn: Connection) -> None:
        """Answer 503 and close, after the client had a moment to finish sending its request."""
        transport = conn.transport
        assert transport is not None
        if len(self._refusing) >= MAX_REFUSING:
            transport.abort()  # a flood of them: no reply rather than descriptors held
            return
        transport.write(REFUSAL)
        if not transport.can_write_eof():  # TLS: close_notify follows the reply
            transport.close()
            return
        self._refusing.add(conn)
        transport.write_eof()
        conn.linger = asyncio.get_running_loop().call_later(REFUSAL_LINGER, transport.abort)

    def close_refusing(self) -> None:
        """Close the turned-away connections still lingering (the server is stopping)."""
        for conn in list(self._refusing):
            if conn.transport is not None:
                conn.transport.abort()
        self._refusing.clear()


class Connection(asyncio.Protocol):
    """One accepted connection: counted in the table, then served by aiohttp's handler (made
    only once admitted), or turned away."""

    def __init__(self, table: ConnectionTable, make_handler: Callable[[], asyncio.Protocol]):
        self.table = table
        self._make_handler = make_handler
        self._handler: asyncio.Protocol | None = None
        self.transport: asyncio.Transport | None = None
        self.address = "?"
        self.counted = False  # open in the table
        self.proven = False  # a request on it carried a valid token
        self.linger: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        peer = transport.get_extra_info("peername")
        self.address = address_key(peer[0] if isinstance(peer, tuple) and peer else None)
        if not self.table.admit(self):
            self.table.refuse(self)
            return
        self._handler = self._make_handler()
        self._handler.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.table.release(self)
        if self.linger is not None:
            self.linger.cancel()
        if self._handler is not None:
            self._handler.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._handler is not None:
            self._handler.data_received(data)
        # else: turned away; the request is read and dropped, so closing resets nothing

    def eof_received(self) -> bool | None:
        if self._handler is not None:
            return self._handler.eof_received()
        return False  # turned away: the client has read the reply and is done

    def pause_writing(self) -> None:
        if self._handler is not None:
            self._handler.pause_writing()

    def resume_writing(self) -> None:
        if self._handler is not None:
            self._handler.resume_writing()


def vouch(request: web.BaseRequest) -> None:
    """A request on this connection carried a valid token: it stops counting as unproven."""
    transport = request.transport
    conn = transport.get_protocol() if transport is not None else None
    if isinstance(conn, Connection) and not conn.proven:
        conn.proven = True
        conn.table.prove(conn)


class LimitedSite(web.BaseSite):
    """aiohttp's ``TCPSite`` with each connection admitted by ``table`` (see the module
    docstring); TLS handshakes get ``handshake_timeout`` seconds."""

    __slots__ = ("_host", "_port", "_table", "_handshake_timeout")

    def __init__(
        self,
        runner: web.BaseRunner,
        host: str,
        port: int,
        table: ConnectionTable,
        *,
        ssl_context: ssl.SSLContext | None = None,
        handshake_timeout: float = 60.0,
    ) -> None:
        super().__init__(runner, ssl_context=ssl_context)
        self._host = host
        self._port = port
        self._table = table
        self._handshake_timeout = handshake_timeout

    @property
    def name(self) -> str:
        scheme = "https" if self._ssl_context else "http"
        return f"{scheme}://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        make_handler = self._runner.server
        assert make_handler is not None
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: Connection(self._table, make_handler),
            self._host,
            self._port,
            ssl=self._ssl_context,
            backlog=self._backlog,
            reuse_address=True,
            ssl_handshake_timeout=self._handshake_timeout if self._ssl_context else None,
        )

    async def stop(self) -> None:
        self._table.close_refusing()
        await super().stop()
