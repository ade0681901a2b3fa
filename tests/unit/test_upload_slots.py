"""Upload slots: the next body fills a buffer only behind the add still reading it."""

from __future__ import annotations

import asyncio
import threading

import pytest

from diloco.server.intake.upload_slots import SlotPool
from diloco.wire import aread_payload
from tests.helpers.aio import let_loop_run

WAIT = 5.0  # seconds; generous bounds on waits that should end at once


def test_next_body_is_written_only_below_what_the_add_has_read() -> None:
    async def scenario() -> None:
        pool = SlotPool(8, slots=1)
        go = threading.Event()
        async with pool.take() as first:
            slot = first.slot
            drain = await first.hand_over()

        def add() -> None:  # stands in for WeightedSum.add reading the first body
            drain.report(4)
            assert go.wait(WAIT)
            drain.report(8)

        adding = asyncio.ensure_future(drain.run(add))
        passed: list[int] = []
        half = asyncio.Event()

        async def next_body() -> None:
            async with pool.take() as second:
                assert second.slot is slot  # the one buffer, handed over
                await second.slot.room(4)
                passed.append(4)
                half.set()
                await second.slot.room(8)
                passed.append(8)

        writer = asyncio.ensure_future(next_body())
        await asyncio.wait_for(half.wait(), WAIT)
        await let_loop_run()  # the add holds bytes 4..8 until `go`: the writer cannot pass
        assert passed == [4] and slot.drain is drain
        go.set()
        await asyncio.wait_for(writer, WAIT)
        await asyncio.wait_for(adding, WAIT)
        assert passed == [4, 8] and slot.drain is None and slot.free_below == 8

    asyncio.run(scenario())


def test_hand_over_waits_until_the_previous_add_is_done() -> None:
    async def scenario() -> None:
        pool = SlotPool(8, slots=1)
        async with pool.take() as first:
            drain = await first.hand_over()
        drain.report(8)  # everything read, but the add has not said it is finished
        async with pool.take() as second:
            handing = asyncio.ensure_future(second.hand_over())
            await let_loop_run()
            assert not handing.done()
            drain.finish()
            second_drain = await asyncio.wait_for(handing, WAIT)
        # A report of the first add that arrives late does not free the second body.
        drain._advance(8)
        assert second_drain.read_upto == 0 and second_drain._slot.free_below == 0
        second_drain.finish()

    asyncio.run(scenario())


def test_a_refused_body_gives_the_slot_back_without_touching_the_mark() -> None:
    async def scenario() -> None:
        pool = SlotPool(8, slots=1)
        async with pool.take() as lease:
            pass  # e.g. the body was cut off: never handed over
        assert not lease.handed_over and lease.slot.drain is None
        async with pool.take() as again:
            assert again.slot is lease.slot
            await asyncio.wait_for(again.slot.room(8), WAIT)

    asyncio.run(scenario())


def test_a_cancelled_add_holds_the_buffer_until_its_thread_ends() -> None:
    async def scenario() -> None:
        pool = SlotPool(8, slots=1)
        async with pool.take() as lease:
            drain = await lease.hand_over()
        started, release = threading.Event(), threading.Event()

        def add() -> None:
            started.set()
            assert release.wait(WAIT)

        task = asyncio.ensure_future(drain.run(add))
        assert await asyncio.to_thread(started.wait, WAIT)
        task.cancel()
        await let_loop_run()
        # Still reading: the buffer stays the add's, and the caller is still waiting.
        assert lease.slot.drain is drain and not task.done()
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, WAIT)
        assert lease.slot.drain is None

    asyncio.run(scenario())


class _Parts:
    """A stream handing out fixed parts, as aiohttp's readany() does."""

    def __init__(self, parts: list[bytes]) -> None:
        self._parts = list(parts)

    async def readany(self) -> bytes:
        return self._parts.pop(0) if self._parts else b""

    async def read(self, n: int = -1) -> bytes:
        return await self.readany()


def test_aread_payload_asks_for_room_before_each_write() -> None:
    async def scenario() -> None:
        dest = bytearray(b"\0" * 6)
        asked: list[tuple[int, bytes]] = []

        async def room(end: int) -> None:
            asked.append((end, bytes(dest)))  # what the memory held when room was asked

        await aread_payload(_Parts([b"ab", b"cde", b"f"]), memoryview(dest), room=room)
        assert dest == b"abcdef"
        assert asked == [(2, b"\0" * 6), (5, b"ab\0\0\0\0"), (6, b"abcde\0")]

    asyncio.run(scenario())
