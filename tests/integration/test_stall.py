"""StallGuard: a body read ends when the peer goes quiet, and only then."""

from __future__ import annotations

import asyncio

import pytest

from diloco.server.web.stall import StallGuard
from diloco.wire import WireError, aread_payload

QUIET = 0.05  # seconds the guard allows; the scenarios wait longer only where it must not fire


class Feed:
    """A request stream fed by the test: each read returns the next chunk put in."""

    def __init__(self) -> None:
        self.chunks: asyncio.Queue[bytes] = asyncio.Queue()

    async def read(self, n: int = -1) -> bytes:
        return await self.chunks.get()

    async def readany(self) -> bytes:
        return await self.chunks.get()


def test_a_quiet_sender_mid_body_gets_408() -> None:
    async def scenario() -> None:
        feed = Feed()
        feed.chunks.put_nowait(b"abcd")  # half the body, then nothing
        dest = memoryview(bytearray(8))
        with pytest.raises(WireError) as err:
            async with StallGuard(QUIET) as guard:
                await aread_payload(guard.watch(feed), dest)
        assert err.value.code == "body_timeout" and err.value.status == 408
        assert bytes(dest[:4]) == b"abcd"

    asyncio.run(scenario())


def test_time_the_server_spends_on_its_own_does_not_count() -> None:
    async def scenario() -> None:
        feed = Feed()
        room = asyncio.Event()

        async def wait_for_room(end: int) -> None:
            if end > 4:
                await room.wait()  # the server's own wait (the buffer is still being added)

        async def open_room_later() -> None:
            await asyncio.sleep(QUIET * 6)
            room.set()

        for chunk in (b"abcd", b"efgh", b""):  # all there at once; b"": the end of the body
            feed.chunks.put_nowait(chunk)
        dest = memoryview(bytearray(8))
        opener = asyncio.ensure_future(open_room_later())
        async with StallGuard(QUIET) as guard:
            await asyncio.sleep(QUIET * 3)  # before the first read: not waiting for the peer
            await aread_payload(guard.watch(feed), dest, room=wait_for_room)
        await opener
        assert bytes(dest) == b"abcdefgh" and not guard.expired

    asyncio.run(scenario())


def test_someone_elses_cancel_is_not_turned_into_a_timeout() -> None:
    async def scenario() -> None:
        feed = Feed()
        started = asyncio.Event()

        async def read() -> None:
            async with StallGuard(60.0) as guard:
                started.set()
                await guard.watch(feed).read()

        task = asyncio.ensure_future(read())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())


def test_zero_turns_the_guard_off() -> None:
    async def scenario() -> None:
        feed = Feed()

        async def deliver_late() -> None:
            await asyncio.sleep(QUIET * 4)
            feed.chunks.put_nowait(b"ab")

        late = asyncio.ensure_future(deliver_late())
        async with StallGuard(0) as guard:
            assert await guard.watch(feed).read() == b"ab"
        await late
        assert not guard.expired

    asyncio.run(scenario())


def test_negative_seconds_are_refused() -> None:
    with pytest.raises(ValueError, match="seconds"):
        StallGuard(-1)


def test_a_trickling_sender_gets_408_too_slow() -> None:
    """It is never quiet for ``seconds``, but brings far less than ``min_rate`` per window."""

    async def scenario() -> None:
        feed = Feed()

        async def trickle() -> None:
            while True:
                await asyncio.sleep(QUIET / 5)
                feed.chunks.put_nowait(b"x")

        dripping = asyncio.ensure_future(trickle())
        dest = memoryview(bytearray(1000))
        with pytest.raises(WireError) as err:
            async with StallGuard(60.0, min_rate=1000, rate_window=QUIET * 2) as guard:
                await aread_payload(guard.watch(feed), dest)
        dripping.cancel()
        assert err.value.code == "too_slow" and err.value.status == 408

    asyncio.run(scenario())


def test_the_rate_counts_only_time_spent_waiting_for_the_sender() -> None:
    """Bytes that are there when read arrive at once, however long the server takes between
    reads: the server being busy must not make the sender look slow."""

    async def scenario() -> None:
        feed = Feed()
        for _ in range(4):
            feed.chunks.put_nowait(b"ab")
        async with StallGuard(60.0, min_rate=1e9, rate_window=QUIET) as guard:
            stream = guard.watch(feed)
            for _ in range(4):
                assert await stream.read() == b"ab"
                await asyncio.sleep(QUIET * 2)  # the server's own work
        assert not guard.expired

    asyncio.run(scenario())


def test_a_sender_fast_enough_passes_window_after_window() -> None:
    async def scenario() -> None:
        feed = Feed()

        async def send() -> None:
            for _ in range(8):
                await asyncio.sleep(QUIET / 2)
                feed.chunks.put_nowait(b"y" * 100)  # 2000 bytes/s
            feed.chunks.put_nowait(b"")  # the end of the body

        sender = asyncio.ensure_future(send())
        dest = memoryview(bytearray(800))
        async with StallGuard(60.0, min_rate=200, rate_window=QUIET) as guard:
            await aread_payload(guard.watch(feed), dest)
        await sender
        assert not guard.expired and bytes(dest) == b"y" * 800

    asyncio.run(scenario())


def test_a_minimum_rate_needs_a_window() -> None:
    with pytest.raises(ValueError, match="rate_window"):
        StallGuard(1.0, min_rate=10.0)
