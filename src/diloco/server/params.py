"""The global parameters, kept as one contiguous fp32 payload that downloads stream from directly.

The parameters the outer optimizer updates are views into a single buffer laid out exactly as
the body of ``GET /global_params``. A round's result is therefore serialized zero times: every
waiting connection streams the same immutable bytes. Immutability is kept by copy-on-write: an
outer step runs in place when nobody is downloading, and on a fresh copy when a slow reader still
holds the current buffer (the reader keeps its round; memory returns when it finishes).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from diloco.wire import Layout, TensorSpec, build_layout, byte_view, tensor_views


class _Buffer:
    """A payload buffer with a count of the downloads streaming from it."""

    def __init__(self, payload: torch.Tensor) -> None:
        self.payload = payload
        self.readers = 0


@dataclass
class Snapshot:
    """What a download streams: the header of its round and the payload it points into.
    ``parts`` is the whole payload, or the byte ranges of one fragment's pieces."""

    round: int
    header: bytes
    payload: memoryview
    _buffer: _Buffer
    parts: list[memoryview] | None = None

    @property
    def body_parts(self) -> list[memoryview]:
        return self.parts if self.parts is not None else [self.payload]

    @property
    def total_size(self) -> int:
        return len(self.header) + sum(len(p) for p in self.body_parts)


class ParamStore:
    """Global parameters of one model (fp32, CPU) with their published form."""

    def __init__(
        self, specs: list[TensorSpec], round: int = 0, instance: str | None = None
    ) -> None:
        for spec in specs:
            if spec.dtype != "F32":
                raise ValueError(f"parameter table entries are fp32, {spec.name!r} is {spec.dtype}")
        self.instance = instance or uuid.uuid4().hex[:12]
        self.layout: Layout = build_layout(specs)
        self.specs = list(self.layout.specs)  # payload order
        self.table: dict[str, tuple[int, ...]] = {s.name: s.shape for s in self.specs}
        self.round = round
        self._buffer = _Buffer(torch.zeros(self.layout.payload_size, dtype=torch.uint8))
        self.params = [
            torch.nn.Parameter(t, requires_grad=False) for t in self._views(self._buffer)
        ]
        #: Extra header metadata of full downloads (fragment rounds when streaming).
        self.header_meta: Callable[[], dict[str, str]] | None = None
        #: Called after a copy-on-write moved the parameters to a fresh buffer, so views made
        #: from them (fragment pieces) can follow.
        self.on_new_buffer: Callable[[], None] | None = None
        self._header = self._make_header()
        self._idle = asyncio.Event()
        self._idle.set()
        self._round_changed = asyncio.Condition()
        self.copies_on_write = 0

    # --- construction ---------------------------------------------------------------------

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor], round: int = 0) -> ParamStore:
        """Build from named tensors of any floating dtype (copied and cast to fp32)."""
        specs = []
        for name, t in tensors.items():
            if not t.is_floating_point():
                raise ValueError(
                    f"parameter {name!r} is {t.dtype}; only floating-point parameters are synced"
                )
            specs.append(TensorSpec(name, "F32", tuple(t.shape)))
        store = cls(specs, round)
        by_name = store.named()
        with torch.no_grad():
            for name, t in tensors.items():
                by_name[name].copy_(t)
        return store

    def _views(self, buffer: _Buffer) -> list[torch.Tensor]:
        views = tensor_views(self.layout, buffer.payload)
        return [views[s.name] for s in self.specs]

    def _make_header(self) -> bytes:
        meta = {"round": str(self.round), "instance": self.instance, "kind": "global_params"}
        if self.header_meta is not None:
            meta.update(self.header_meta())
        return build_layout(self.specs, meta).header

    def refresh_header(self) -> None:
        self._header = self._make_header()

    def named(self) -> dict[str, torch.Tensor]:
        return {s.name: p.data for s, p in zip(self.specs, self.params, strict=True)}

    def copy_out(self) -> dict[str, torch.Tensor]:
        return {name: t.clone() for name, t in self.named().items()}

    @property
    def nbytes(self) -> int:
        return self.layout.payload_size

    @property
    def numel(self) -> int:
        return sum(s.numel for s in self.specs)

    # --- readers --------------------------------------------------------------------------

    async def open_snapshot(self) -> Snapshot:
        """Pin the current round's bytes. Waits while an outer step is being applied."""
        await self._idle.wait()
        buf = self._buffer
        buf.readers += 1
        return Snapshot(self.round, self._header, byte_view(buf.payload), buf)

    @staticmethod
    def close_snapshot(snap: Snapshot) -> None:
        snap._buffer.readers -= 1

    async def open_parts(
        self, header: Callable[[], bytes], ranges: list[tuple[int, int]], round: int
    ) -> Snapshot:
        """Pin the current bytes and hand out the given payload byte ranges (one fragment)."""
        await self._idle.wait()
        buf = self._buffer
        buf.readers += 1
        payload = byte_view(buf.payload)
        return Snapshot(round, header(), payload, buf, [payload[a:b] for a, b in ranges])

    async def wait_for_round(self, min_round: int, timeout: float) -> bool:
        """Wait until the published round reaches ``min_round``. False on timeout."""
        return await self.wait_until(lambda: self.round >= min_round, timeout)

    async def wait_until(self, predicate: Callable[[], bool], timeout: float) -> bool:
        """Wait until ``predicate()`` holds after a publication. False on timeout."""
        async with self._round_changed:
            try:
                await asyncio.wait_for(self._round_changed.wait_for(predicate), timeout)
            except TimeoutError:
                return False
        return True

    # --- writers --------------------------------------------------------------------------

    async def update(
        self,
        fn: Callable[[], None],
        *,
        new_round: int | None = None,
        on_publish: Callable[[], None] | None = None,
    ) -> None:
        """Run ``fn`` (which mutates ``self.params`` in place) off the event loop, then publish.
        ``on_publish`` runs on the loop just before waiters are woken (to move round counters
        that their predicates read).

        Readers that arrive meanwhile wait; readers already streaming keep the old bytes."""
        self._idle.clear()
        try:
            if self._buffer.readers:
                await asyncio.to_thread(self._copy_on_write)
            await asyncio.to_thread(fn)
            if new_round is not None:
                self.round = new_round
            if on_publish is not None:
                on_publish()
            self._header = self._make_header()
        finally:
            self._idle.set()
        async with self._round_changed:
            self._round_changed.notify_all()

    def _copy_on_write(self) -> None:
        fresh = _Buffer(self._buffer.payload.clone())
        with torch.no_grad():
            for p, view in zip(self.params, self._views(fresh), strict=True):
                p.data = view
        self._buffer = fresh
        self.copies_on_write += 1
        if self.on_new_buffer is not None:
            self.on_new_buffer()
