"""Giving up on request bodies whose sender has gone quiet.

An upload holds a receive buffer while its body arrives, and the next upload waits for that
buffer. A sender that stops mid-body without closing the connection (a machine that lost power,
a cut link: no FIN ever comes) would hold it until TCP keepalive notices, hours with stock kernel
settings, and every other worker's upload would wait as long. So a body read ends when the peer
has sent nothing for ``seconds`` while the server was waiting for it; time the server spends on
its own (waiting for the buffer, adding) does not count.

The check is a timer that fires once per ``seconds``, not a timeout per read: a 100M upload
arrives in thousands of reads, and re-arming a timer (or even reading the clock) on each would
cost more than the read itself. A read still under way at two checks in a row has waited at
least ``seconds``, so a quiet sender is dropped after between one and two times ``seconds``.
"""

from __future__ import annotations

import asyncio
from types import TracebackType

from diloco.wire import WireError
from diloco.wire.decode import AsyncStream


class StallGuard:
    """``async with StallGuard(seconds) as guard:`` around a body read, with the request's
    stream wrapped by ``guard.watch(stream)``. When one read of it waits for the peer for
    ``seconds`` (up to twice that before it is noticed), the read is cancelled and the block
    raises ``WireError('body_timeout')`` (status 408). ``seconds = 0`` turns the guard off."""

    def __init__(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"seconds must be >= 0, got {seconds}")
        self.seconds = seconds
        self.expired = False
        self._reads = 0  # reads begun so far
        self._reading = False  # a read is waiting for the peer now
        self._seen = -1  # the read under way at the last check (-1: none)
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
        self._reading = False
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
        self._reads += 1
        self._reading = True

    def _end(self) -> None:
        self._reading = False

    def _check(self) -> None:
        assert self._loop is not None and self._task is not None
        if self._reading and self._seen == self._reads:
            self.expired = True  # the same read was already waiting at the previous check
            self._timer = None
            self._task.cancel()
            return
        self._seen = self._reads if self._reading else -1
        self._timer = self._loop.call_later(self.seconds, self._check)


class WatchedStream:
    """A request stream whose reads count as waiting for the peer (see ``StallGuard``)."""

    def __init__(self, stream: AsyncStream, guard: StallGuard) -> None:
        self._stream = stream
        self._guard = guard
        # aread_payload takes readinto() (a socket body) or aiohttp's readany() (no slicing
        # copy) where the stream has them.
        if hasattr(stream, "readinto"):
            self.readinto = self._readinto
        if hasattr(stream, "readany"):
            self.readany = self._readany

    async def read(self, n: int = -1) -> bytes:
        self._guard._begin()
        try:
            return await self._stream.read(n)
        finally:
            self._guard._end()

    async def _readany(self) -> bytes:
        self._guard._begin()
        try:
            return await self._stream.readany()  # type: ignore[attr-defined]
        finally:
            self._guard._end()

    async def _readinto(self, view: memoryview) -> int:
        self._guard._begin()
        try:
            return await self._stream.readinto(view)  # type: ignore[attr-defined]
        finally:
            self._guard._end()
