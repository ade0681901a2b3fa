"""The first upload of a round, written into the running sum as it arrives.

An upload counts only once its whole body has landed and passed its checks (a cut or non-finite
body must change nothing), so uploads are received into an upload slot and added afterwards
(server/intake/upload_slots.py), one slot at a time by default. The round's first upload is the
exception: while no contribution counts, the sum holds nothing that matters (the first add
overwrites it rather than adding to it), so that upload is written into the sum stretch by
stretch as it arrives: each stretch lands in a small stage, is checked for NaN and infinities and
written (times its weight) into the sum while the next one is received. A body that is cut,
turns out non-finite, or whose worker is gone when it ends leaves a sum that still counts
nothing. It takes no slot, so a second upload is received into the slot at the same time, and its
bytes cross memory once fewer.

While it runs it owns its unit's sum: the coordinator starts one only when nothing counts and no
add is pending, and an add (or a close) waits for it to end. A close waits only if the writing
worker left mid-upload (otherwise the round is still waiting for that upload): until its body ends,
or `body_timeout` drops a quiet sender.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Callable, Iterator

import torch

from diloco.core.accumulate import WeightedSum
from diloco.server.errors import ApiError
from diloco.wire import Layout, PayloadReader, byte_view

STAGE_BYTES = 4 * 1024 * 1024
"""Bytes of one stage: what one socket receive asks for (server/web/socket_body.py), so a stretch is
one or a few receives and is still in cache when it is written into the sum."""


class Stages:
    """The two stages a first write alternates between: one receives while the other is
    written into the sum. Allocated once, on first use."""

    def __init__(self, nbytes: int | None = None) -> None:
        self.nbytes = STAGE_BYTES if nbytes is None else nbytes
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None

    def get(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._buffers is None:
            self._buffers = (
                torch.empty(self.nbytes, dtype=torch.uint8),
                torch.empty(self.nbytes, dtype=torch.uint8),
            )
        return self._buffers


class FirstWrite:
    """One upload written into ``wsum`` as it arrives; ``done`` is set once nothing of it runs
    any more (its last stretch included), whatever the outcome."""

    def __init__(
        self,
        wsum: WeightedSum,
        names: list[str],
        layout: Layout,
        weight: float,
        stages: Stages,
        worker_id: str,
    ) -> None:
        self.worker_id = worker_id
        self.done = asyncio.Event()
        self._wsum = wsum
        self._index = {name: i for i, name in enumerate(names)}
        self._layout = layout
        self._weight = weight
        self._stages = stages
        self._pending: asyncio.Future[None] | None = None

    def stretches(self) -> Iterator[tuple[int, str, torch.dtype, int, int]]:
        """``(sum index, name, dtype, first element, bytes)`` in payload order; a stretch never
        crosses a tensor, so its bytes are whole elements of one dtype."""
        for spec in self._layout.specs:
            per = self._stages.nbytes // spec.itemsize
            for start in range(0, spec.numel, per):
                n = min(per, spec.numel - start)
                yield self._index[spec.name], spec.name, spec.torch_dtype, start, n * spec.itemsize

    async def run(self, reader: PayloadReader) -> None:
        """Receive the payload and write it into the sum. Raises ``WireError`` for a cut or
        overlong body and ``ApiError`` 422 for a non-finite one; the sum then counts nothing
        (nothing here commits it: the caller does, after its own checks)."""
        stages = self._stages.get()
        try:
            for k, (i, name, dtype, start, nbytes) in enumerate(self.stretches()):
                stage = stages[k % 2]  # the other one may still be being written into the sum
                await reader.fill(byte_view(stage)[:nbytes])
                if self._pending is not None:
                    await self._pending  # frees the stage the next stretch will receive into
                self._pending = asyncio.ensure_future(
                    asyncio.to_thread(self._write, i, name, stage[:nbytes].view(dtype), start)
                )
            if self._pending is not None:
                await self._pending
            await reader.end()
        finally:
            pending = self._pending
            if pending is not None and not pending.done():
                # The write thread cannot be stopped: wait for it before anything else may
                # touch the sum (the stage and the sum stay ours until then).
                with contextlib.suppress(BaseException):
                    await asyncio.shield(pending)

    def _write(self, i: int, name: str, piece: torch.Tensor, start: int) -> None:
        low, high = torch.aminmax(piece)  # NaN propagates into both; an infinity is one of them
        if not (math.isfinite(float(low)) and math.isfinite(float(high))):
            raise ApiError(
                422, "non_finite", f"pseudo-gradient {name!r} has NaN or infinite values"
            )
        self._wsum.write_first(i, start, piece, self._weight)

    def finish(self, release: Callable[[], object]) -> None:
        """Call ``release`` (and set ``done``) now, or when the last stretch's thread ends if a
        second cancellation cut the wait for it short."""

        def end(_: object = None) -> None:
            release()
            self.done.set()

        pending = self._pending
        if pending is not None and not pending.done():
            pending.add_done_callback(end)
        else:
            end()
