"""Tensor uploads received straight from the socket into their buffer.

Through aiohttp every upload byte is touched three times in user space on the event loop: the
transport's read makes a ``bytes`` of each 256 KiB, the HTTP parser copies the body part of it
into another, and the server copies that into the receive buffer, a Python round trip per
chunk. Here the kernel writes the payload into the buffer with ``recv_into`` and nothing else
touches it, which is what the benchmark's raw-socket limit does (docs/benchmarks.md).

How it stays correct with aiohttp in charge of the connection:

- The client asks ``Expect: 100-continue`` and sends no body byte before ``100 Continue``. The
  route's expect handler does not answer it (``defer_continue``); the handler does, after
  pausing the transport. Bytes the transport has not read stay in the kernel, in order.
- The switch needs that aiohttp has seen no body byte (``content.total_bytes == 0``): a body
  byte it has read may still sit in its parser, where nothing public can reach it. A client that
  sends the body early anyway simply gets the ordinary path. Checking and pausing happen in one
  step of the event loop, so no read can come between them.
- The body is read from a duplicate of the socket's descriptor (asyncio refuses socket calls on
  a descriptor a transport owns), never past ``Content-Length``.
- aiohttp's parser still waits for the body it never saw, so the connection cannot carry
  another request: the reply says ``Connection: close`` and the body is marked finished so
  aiohttp does not wait to discard it. The rest of a body refused midway is read away here
  instead, before the socket closes, so the client can read its reply.

TLS connections, HTTP/1.0, chunked bodies and clients that do not ask for ``100-continue`` take
aiohttp's stream instead (``_tensor_body`` in app.py), with the same checks and results.
"""

from __future__ import annotations

import asyncio
import socket

from aiohttp import HttpVersion11, hdrs, web

from diloco.server.web.security import expect_handler

READ_BYTES = 4 * 1024 * 1024
"""Most bytes asked of one receive: about what a socket buffer holds, so a receive returns
whatever has arrived without a Python round trip per small chunk."""

SMALL_READ = 1024 * 1024
"""Most bytes one ``read(n)`` allocates (the safetensors header may declare up to 16 MiB)."""

LINGER_SECONDS = 10.0
"""Longest the rest of a refused body is read away (aiohttp's own lingering time)."""

_DISCARDING: set[asyncio.Task[None]] = set()  # the loop keeps only weak references to tasks

DIRECT: web.RequestKey[bool] = web.RequestKey("direct_body", bool)
"""Set on a request whose body is read from the socket: its reply closes the connection."""


def direct_possible(request: web.Request) -> bool:
    """Whether the body can be taken from the socket (see the module docstring)."""
    transport = request.transport
    if transport is None or transport.is_closing():
        return False
    if transport.get_extra_info("sslcontext") is not None:
        return False  # TLS: the socket holds ciphertext
    if transport.get_extra_info("socket") is None:
        return False
    return (
        request.version == HttpVersion11
        and request.headers.get(hdrs.EXPECT, "").lower() == "100-continue"
        and request.content_length is not None
        and hdrs.TRANSFER_ENCODING not in request.headers
        and request.content.total_bytes == 0
    )


class SocketBody:
    """The body of one request, read from a duplicate of its socket while aiohttp's transport
    is paused. Offers ``read`` (the header) and ``readinto`` (the payload).
    Use ``await SocketBody.open(request)`` when ``direct_possible(request)``; ``close`` it."""

    def __init__(self, request: web.Request, sock: socket.socket, length: int) -> None:
        self._request = request
        self._sock = sock
        self._loop = asyncio.get_running_loop()
        self.remaining = length

    @classmethod
    async def open(cls, request: web.Request) -> SocketBody:
        transport = request.transport
        assert transport is not None and request.content_length is not None
        transport.pause_reading()  # from here the body stays in the kernel for us
        request[DIRECT] = True
        sock = transport.get_extra_info("socket").dup()
        sock.setblocking(False)
        try:
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        except BaseException:
            sock.close()
            raise
        return cls(request, sock, request.content_length)

    def close(self) -> None:
        # aiohttp must not linger to discard a body it never saw.
        self._request.content.feed_eof()
        if self.remaining <= 0:
            self._sock.close()  # the duplicate only: aiohttp still owns the connection
            return
        # Refused before its end (409, 410, 400...): the rest is read away before the socket
        # closes, or the kernel answers the client's next bytes with a reset that can destroy
        # the reply before the client reads it. The duplicate keeps the socket open after
        # aiohttp closes its own descriptor behind the reply.
        task = self._loop.create_task(self._discard_rest())
        _DISCARDING.add(task)
        task.add_done_callback(_DISCARDING.discard)

    async def _discard_rest(self) -> None:
        scratch = memoryview(bytearray(min(self.remaining, READ_BYTES)))
        try:
            async with asyncio.timeout(LINGER_SECONDS):
                while self.remaining > 0 and await self.readinto(scratch):
                    pass
        except (OSError, TimeoutError):
            pass  # the client went away, or is too slow to be waited for
        finally:
            self._sock.close()

    async def readinto(self, view: memoryview) -> int:
        """Receive up to ``len(view)`` bytes of the body into ``view``; 0 at its end (or when
        the client closed early)."""
        want = min(len(view), self.remaining)
        if want <= 0:
            return 0
        n = await self._loop.sock_recv_into(self._sock, view[:want])
        self.remaining -= n
        if n == 0:
            self.remaining = 0  # closed before Content-Length: the caller sees the shortfall
        return n

    async def read(self, n: int = -1) -> bytes:
        want = self.remaining if n < 0 else min(n, self.remaining)
        want = min(want, SMALL_READ)
        if want <= 0:
            return b""
        data = await self._loop.sock_recv(self._sock, want)
        self.remaining = self.remaining - len(data) if data else 0
        return data


async def defer_continue(request: web.Request) -> web.StreamResponse | None:
    """Expect handler of the upload routes: when the body will be taken from the socket, the
    handler sends ``100 Continue`` itself, after pausing the transport."""
    if direct_possible(request):
        return None
    return await expect_handler(request)
