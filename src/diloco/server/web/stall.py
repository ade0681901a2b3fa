"""Giving up on request bodies whose sender has gone quiet, or crawls.

An upload holds a receive buffer while its body arrives, and the next upload waits for that
buffer. A sender that stops mid-body without closing the connection (a machine that lost power,
a cut link: no FIN ever comes) would hold it until TCP keepalive notices, hours with stock kernel
settings, and every other worker's upload would wait as long. So a body read ends when the peer
has sent nothing for ``seconds`` while the server was waiting for it; time the server spends on
its own (waiting for the buffer, adding) does not count.

A sender that never goes quiet but trickles (a byte every few seconds, by accident or on
purpose) holds the buffer just as long, so the body is also dropped when, over ``rate_window``
seconds of waiting for the peer, it delivered less than ``min_rate`` bytes per second. Again
only time spent waiting for the peer counts: a server busy elsewhere leaves the client blocked
by TCP flow control, and that must not look slow.

The quiet check is a timer that fires once per ``seconds``, not a timeout per read: a 100M upload
arrives in thousands of reads, and re-arming a timer on each would cost more than the read
itself. A read still under way at two checks in a row has waited at least ``seconds``, so a quiet
sender is dropped after between one and two times ``seconds``. The rate check reads the loop's
clock at the start and end of each read (tens of nanoseconds against a read of kilobytes to
megabytes) and looks at the total once a window of waiting has passed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import TracebackType

from diloco.wire import WireError
from diloco.wire.decode import AsyncStream


class StallGuard:
    """``async with StallGuard(seconds) as guard:`` around a body read, with the request's
    stream wrapped by ``guard.watch(stream)``. When one read of it waits for the peer for
    ``seconds`` (up to twice that before it is noticed), the read is cancelled and the block
    raises ``WireError('body_timeout')`` (status 408). ``seconds = 0`` turns that check off.

    With ``min_rate > 0``, each ``rate_window`` seconds spent waiting for the peer must bring at
    least ``min_rate * rate_window`` bytes, else the block raises ``WireError('too_slow')``
    (status 408) in the same way."""

    def __init__(self, seconds: float, min_rate: float = 0.0, rate_window: float = 0.0) -> None:
        if seconds < 0:
            raise ValueError(f"seconds must be >= 0, got {seconds}")
        if min_rate < 0 or (min_rate > 0 and not rate_window > 0):
            raise ValueError(
                f"min_rate must be >= 0 and, when > 0, rate_window > 0; got {min_rate}, {rate_window}"
            )
        self.seconds = seconds
        self.min_rate = min_rate
        self.rate_window = rate_window
        self.expired = False
        self._error: WireError | None = None  # why the guard cancelled the read
        self._reads = 0  # reads begun so far
        self._reading = False  # a read is waiting for the peer now
        self._seen = -1  # the read under way at the last check (-1: none)
        self._task: asyncio.Task[object] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        # The rate check: bytes received, seconds spent waiting for the peer, and both at the
        # start of the current window.
        self._time: Callable[[], float] | None = None
        self._began = 0.0  # when the read under way began
        self._bytes = 0
        self._waited = 0.0
        self._window_bytes = 0
        self._window_waited = 0.0
        self._rate_timer: asyncio.TimerHandle | None = None

    async def __aenter__(self) -> StallGuard:
        if self.seconds > 0 or self.min_rate > 0:
            self._loop = asyncio.get_running_loop()
            self._task = asyncio.current_task()
        if self.seconds > 0:
            assert self._loop is not None
            self._timer = self._loop.call_later(self.seconds, self._check)
        if self.min_rate > 0:
            assert self._loop is not None
            self._time = self._loop.time
            self._rate_timer = self._loop.call_later(self.rate_window, self._check_rate)
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for timer in (self._timer, self._rate_timer):
            if timer is not None:
                timer.cancel()
        self._timer = self._rate_timer = None
        self._reading = False
        if self.expired and kind is not None and issubclass(kind, asyncio.CancelledError):
            assert self._task is not None and self._error is not None
            if self._task.uncancel() == 0:  # our cancel only: anyone else's goes through
                raise self._error from None

    def watch(self, stream: AsyncStream) -> WatchedStream:
        return WatchedStream(stream, self)

    def _begin(self) -> None:
        self._reads += 1
        self._reading = True
        if self._time is not None:
            self._began = self._time()

    def _end(self, received: int) -> None:
        self._reading = False
        if self._time is not None:
            self._waited += self._time() - self._began
            self._bytes += received

    def _expire(self, error: WireError) -> None:
        assert self._task is not None
        if self.expired:
            return
        self.expired = True
        self._error = error
        for timer in (self._timer, self._rate_timer):
            if timer is not None:
                timer.cancel()
        self._timer = self._rate_timer = None
        self._task.cancel()

    def _check(self) -> None:
        assert self._loop is not None
        self._timer = None
        if self._reading and self._seen == self._reads:
            # The same read was already waiting at the previous check.
            self._expire(
                WireError(
                    "body_timeout",
                    f"the client sent nothing for {self.seconds:g} s in the middle of the body",
                    status=408,
                )
            )
            return
        self._seen = self._reads if self._reading else -1
        self._timer = self._loop.call_later(self.seconds, self._check)

    def _check_rate(self) -> None:
        assert self._loop is not None and self._time is not None
        self._rate_timer = None
        waited = self._waited + (self._time() - self._began if self._reading else 0.0)
        spent = waited - self._window_waited
        left = self.rate_window - spent
        if left > self.rate_window * 1e-3:
            # The server spent part of the window on its own: wait for the rest of it.
            self._rate_timer = self._loop.call_later(left, self._check_rate)
            return
        got = self._bytes - self._window_bytes
        if got < self.min_rate * spent:
            self._expire(
                WireError(
                    "too_slow",
                    f"the client sent {got} bytes in {spent:.1f} s of the body, less than the "
                    f"minimum of {self.min_rate:g} bytes/s",
                    status=408,
                )
            )
            return
        self._window_bytes, self._window_waited = self._bytes, waited
        self._rate_timer = self._loop.call_later(self.rate_window, self._check_rate)


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
        data = b""
        try:
            data = await self._stream.read(n)
            return data
        finally:
            self._guard._end(len(data))

    async def _readany(self) -> bytes:
        self._guard._begin()
        data = b""
        try:
            data = await self._stream.readany()  # type: ignore[attr-defined]
            return data
        finally:
            self._guard._end(len(data))

    async def _readinto(self, view: memoryview) -> int:
        self._guard._begin()
        received = 0
        try:
            received = await self._stream.readinto(view)  # type: ignore[attr-defined]
            return received
        finally:
            self._guard._end(received)
