"""A round whose bytes are being written: downloads stream what is final while the step runs."""

from __future__ import annotations

import asyncio

import torch

from diloco.server.params.wakeup import Wakeup


class PayloadBuffer:
    """A payload buffer with a count of the downloads streaming from it."""

    def __init__(self, payload: torch.Tensor) -> None:
        self.payload = payload
        self.readers = 0


class Publication:
    """A round whose bytes are being written by an outer step that reports its progress.

    Downloads of the new round start at once and stream the payload up to ``ready``: the bytes
    below it are final. The last byte is held back until ``complete``, which the store calls
    once the round is published, so no client can finish reading a round the server does not
    serve yet (and then, say, submit against a round the barrier has not opened)."""

    def __init__(
        self,
        round: int,
        header: bytes,
        buffer: PayloadBuffer,
        offsets: tuple[tuple[int, int], ...],
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.round = round
        self.header = header
        self.buffer = buffer
        self.ready = 0
        self.failed = False
        self._total = buffer.payload.numel()
        self._loop = loop
        self._base = buffer.payload.data_ptr()
        self._spans = [(begin, end) for begin, end in offsets if end > begin]
        self._index = {begin: i for i, (begin, _) in enumerate(self._spans)}
        self._done = [0] * len(self._spans)  # bytes written of each tensor, in payload order
        self._next = 0  # the first tensor, in payload order, not written in full
        self._moved = Wakeup()

    def report(self, param: torch.Tensor, elements: int) -> None:
        """From the writing thread: the first ``elements`` of ``param`` (a view into this
        payload) hold their new values."""
        begin = param.data_ptr() - self._base
        nbytes = elements * param.element_size()
        self._loop.call_soon_threadsafe(self._advance, begin, nbytes)

    def _advance(self, begin: int, nbytes: int) -> None:
        i = self._index.get(begin)
        if i is None or self.failed:
            return  # not a whole tensor of this payload: it becomes ready at completion
        self._done[i] = max(self._done[i], nbytes)
        # Only a prefix of the payload is ready: tensors may be written in any order.
        while self._next < len(self._spans):
            start, end = self._spans[self._next]
            if self._done[self._next] < end - start:
                break
            self._next += 1
        if self._next < len(self._spans):
            start, _ = self._spans[self._next]
            upto = start + self._done[self._next]
        else:
            upto = self._total
        upto = min(upto, self._total - 1)
        if upto > self.ready:
            self.ready = upto
            self._moved.notify()

    def complete(self) -> None:
        self.ready = self._total
        self._moved.notify()

    def fail(self) -> None:
        self.failed = True
        self._moved.notify()

    async def until(self, end: int) -> None:
        """Wait until payload bytes ``[0, end)`` are final. Raises if the step failed: the
        bytes sent so far belong to no round, and the download must be cut off."""
        await self._moved.until(lambda: self.ready >= end or self.failed)
        if self.ready < end:
            raise RuntimeError(f"the outer step of round {self.round} failed")
