"""Upload receive buffers that the next upload starts filling while the last one is being added.

An upload is received whole before any of it counts (a bad or cut body must change nothing), so
the server holds it in a buffer as large as the largest unit. Adding it to the running sum then
reads that buffer front to back, several times faster than a socket fills it. So as soon as a body
has landed, its buffer goes to the next upload, which may write below the point the adder has
finished reading (the free mark) and waits only if it catches up. One buffer thus serves
back-to-back uploads with each add overlapping the next receive, where it used to be receive,
add, receive, add in series; memory stays one buffer per slot.

Ownership of a slot passes from receive to receive through the pool; the free mark belongs to
whoever reads the buffer: the adder while it runs, nobody (all free) otherwise. Everything here
runs on the event loop thread except the adder's progress reports, which come back through
``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

import torch

from diloco.server.params.wakeup import Wakeup

T = TypeVar("T")


class UploadSlot:
    """One receive buffer and the add (if any) still reading the body last received into it."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.buffer = torch.empty(nbytes, dtype=torch.uint8)
        self.drain: Drain | None = None
        self.moved = Wakeup()  # the free mark rose, or the drain ended

    @property
    def free_below(self) -> int:
        """Bytes ``[0, free_below)`` may be written."""
        return self.nbytes if self.drain is None else self.drain.read_upto

    async def room(self, end: int) -> None:
        """Wait until bytes ``[0, end)`` may be written."""
        await self.moved.until(lambda: self.free_below >= end)

    async def idle(self) -> None:
        """Wait until no add reads the buffer."""
        await self.moved.until(lambda: self.drain is None)


class Drain:
    """The add of one landed body. Until ``finish`` it holds its slot's buffer, of which the
    bytes below ``read_upto`` are already read and may be overwritten."""

    def __init__(self, slot: UploadSlot, loop: asyncio.AbstractEventLoop) -> None:
        self._slot = slot
        self._loop = loop
        self.read_upto = 0

    def report(self, upto: int) -> None:
        """From the adder's thread: bytes below ``upto`` will not be read again."""
        self._loop.call_soon_threadsafe(self._advance, upto)

    def _advance(self, upto: int) -> None:
        # A report can arrive after finish (it was queued first, but the loop may run finish
        # from the caller before it): it then changes nothing.
        if self._slot.drain is self and upto > self.read_upto:
            self.read_upto = upto
            self._slot.moved.notify()

    def finish(self) -> None:
        """The body is no longer read (added, or refused): the whole buffer is free."""
        if self._slot.drain is self:
            self._slot.drain = None
            self._slot.moved.notify()

    async def run(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` (the add, which calls ``report``) in a thread, then ``finish``.

        A cancelled caller still waits for the thread: it reads the buffer, and the caller holds
        the tensor lock, so neither may be given up while it runs."""
        future = asyncio.ensure_future(asyncio.to_thread(fn))
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            with contextlib.suppress(BaseException):
                await future
            raise
        finally:
            if future.done():
                self.finish()
            else:  # only reached if the wait above was interrupted again
                future.add_done_callback(lambda _: self.finish())


class Lease:
    """A receive's hold on a slot, from ``SlotPool.take`` until it ends or hands over."""

    def __init__(self, pool: SlotPool, slot: UploadSlot, waited_s: float) -> None:
        self.slot = slot
        self._pool = pool
        self.handed_over = False
        #: Seconds this receive waited for a free slot (0 if one was free).
        self.waited_s = waited_s

    async def hand_over(self) -> Drain:
        """The body has landed: pass the slot to the next receive and return the drain that
        frees it as the body is read. Call ``finish`` on the drain whatever happens next."""
        assert not self.handed_over
        await self.slot.idle()  # the previous add has finished with its body
        drain = Drain(self.slot, asyncio.get_running_loop())
        self.slot.drain = drain
        self.handed_over = True
        self._pool._put(self.slot)
        return drain


class SlotPool:
    """At most ``slots`` upload buffers of ``nbytes`` each, allocated on first use.

    ``waiting`` counts the receives queued for a slot right now, and each lease says how long
    it waited: where workers reach the server over links slower than the server's own, one slot
    lets their uploads in one at a time, and these are the figures that show it."""

    def __init__(
        self, nbytes: int, slots: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.nbytes = nbytes
        self.slots = slots
        self.waiting = 0
        self._free: asyncio.Queue[UploadSlot] = asyncio.Queue()
        self._to_create = slots
        self._clock = clock

    @contextlib.asynccontextmanager
    async def take(self) -> AsyncIterator[Lease]:
        waited = 0.0
        if self._free.empty() and self._to_create > 0:
            self._to_create -= 1
            slot = UploadSlot(self.nbytes)
        elif not self._free.empty():
            slot = self._free.get_nowait()
        else:
            t0 = self._clock()
            self.waiting += 1
            try:
                slot = await self._free.get()
            finally:
                self.waiting -= 1
            waited = self._clock() - t0
        lease = Lease(self, slot, waited)
        try:
            yield lease
        finally:
            if not lease.handed_over:
                self._put(slot)

    def _put(self, slot: UploadSlot) -> None:
        self._free.put_nowait(slot)
