"""Giving up on request bodies whose sender has gone quiet.

An upload holds a receive buffer while its body arrives, and the next upload waits for that
buffer. A sender that stops mid-body without closing the connection (a machine that lost power,
a cut link: no FIN ever comes) would hold it until TCP keepalive notices, hours with stock kernel
settings, and every other worker's upload would wait as long. So a body read ends when the peer
has sent nothing for ``seconds`` while the server was waiting for it; time the server spends on
its own (waiting for the buffer, adding) does not count.

The check is a timer that fires about once per ``seconds``, not a timeout per read: a 100M
upload arrives in thousands of reads, and re-arming a timer on each would cost more than the
read itself.
"""

from __future__ import annotations

import asyncio
from types import TracebackType

from diloco.wire import WireError
from diloco.wire.decode import AsyncStream


class StallGuard:
    """``async with StallGuard(seconds) as guard:`` around a body read, with the request's
    stream wrapped by ``guard.watch(stream)``. When the peer sends nothing for ``seconds``
    during a read, the read is cancelled and the block raises ``WireError('body_timeout')``
    (status 408). ``seconds = 0`` turns the guard off."""

    def __init__(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"seconds must be >= 0, got {seconds}")
        self.seconds = seconds
        self.expired = False
        self._since: float | None = None  # loop time the current read began, None if none
        self._task: asyncio.Task[object] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None

    async def __aenter__(self) -> StallGuard:
        if self.seconds > 0:
            self._loop = asyncio.get_running_loop()
            self._task = asyncio.current_task()
            self._timer = self._loop.call_later(self.seconds, self._check)
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._since = None
        if self.expired and kind is not None and issubclass(kind, asyncio.CancelledError):
            assert self._task is not None
            if self._task.uncancel() == 0:  # our cancel only: anyone else's goes through
                raise WireError(
                    "body_timeout",
                    f"the client sent nothing for {self.seconds:g} s in the middle of the body",
                    status=408,
                ) from None

    def watch(self, stream: AsyncStream) -> WatchedStream:
        return WatchedStream(stream, self)

    def _begin(self) -> None:
        if self._loop is not None:
            self._since = self._loop.time()

    def _end(self) -> None:
        self._since = None

    def _check(self) -> None:
        assert self._loop is not None and self._task is not None
        since, now = self._since, self._loop.time()
        if since is not None and now - since >= self.seconds:
            self.expired = True
            self._timer = None
            self._task.cancel()
            return
        # Next look: when the read under way (if any) would have waited the full time.
        delay = self.seconds if since is None else self.seconds - (now - since)
        self._timer = self._loop.call_later(delay, self._check)


class WatchedStream:
    """A request stream whose reads count as waiting for the peer (see ``StallGuard``)."""

    def __init__(self, stream: AsyncStream, guard: StallGuard) -> None:
        self._stream = stream
        self._guard = guard
        # aread_payload takes aiohttp's readany() when there is one (no slicing copy).
        if hasattr(stream, "readany"):
            self.readany = self._readany

    async def read(self, n: int = -1) -> bytes:
        self._guard._begin()
        try:
            return await self._stream.read(n)
        finally:
            self._guard._end()

    async def readexactly(self, n: int) -> bytes:
        self._guard._begin()
        try:
            return await self._stream.readexactly(n)
        finally:
            self._guard._end()

    async def _readany(self) -> bytes:
        self._guard._begin()
        try:
            return await self._stream.readany()  # type: ignore[attr-defined]
        finally:
            self._guard._end()
