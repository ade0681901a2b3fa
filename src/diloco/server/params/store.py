"""The global parameters, kept as one contiguous fp32 payload that downloads stream from directly.

The parameters the outer optimizer updates are views into a single buffer laid out exactly as
the body of ``GET /global_params``. A round's result is therefore serialized zero times: every
waiting connection streams the same immutable bytes. Immutability is kept by copy-on-write: an
outer step runs in place when nobody is downloading, and on a fresh copy when a slow reader still
holds the current buffer (the reader keeps its round; memory returns when it finishes).

With a lossy download codec (server/params/update_bodies.py) the outer optimizer's parameters move
to a buffer of their own (``keep_true``: the *true* copy) and the payload holds what was published,
which the downlink writes after each step; copy-on-write then guards the payload alone.

Each published payload has a checksum (``wire.checksum``), computed once per round off the
event loop and carried in full downloads' headers once known.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

import torch

from diloco.core.outer import PieceDone
from diloco.server.params.publication import PayloadBuffer, Publication
from diloco.wire import Layout, TensorSpec, build_layout, byte_view, tensor_views
from diloco.wire.checksum import checksum

F32_BYTES = 4
"""Bytes of one parameter: the store holds them in fp32."""


@dataclass
class Snapshot:
    """What a download streams: the header of its round and the payload it points into.
    ``parts`` is the whole payload, or the byte ranges of one fragment's pieces. ``ready``,
    when set, must be awaited with the end of each payload range before it is sent (the round
    is still being written, see ``Publication``)."""

    round: int
    header: bytes
    payload: memoryview
    _buffer: PayloadBuffer
    parts: list[memoryview] | None = None
    ready: Callable[[int], Awaitable[None]] | None = None
    #: Called once the whole body is sent (the coordinator counts the download).
    on_sent: Callable[[], None] | None = None

    def sent(self) -> None:
        if self.on_sent is not None:
            self.on_sent()

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
        self._buffer = PayloadBuffer(torch.zeros(self.layout.payload_size, dtype=torch.uint8))
        self.params = [
            torch.nn.Parameter(t, requires_grad=False) for t in self._views(self._buffer)
        ]
        #: Extra header metadata of full downloads (fragment rounds when streaming).
        self.header_meta: Callable[[], dict[str, str]] | None = None
        #: Called after a copy-on-write moved the parameters to a fresh buffer, so views made
        #: from them (fragment pieces) can follow.
        self.on_new_buffer: Callable[[], None] | None = None
        #: Named in full downloads' headers (``ServerConfig.download_codec``).
        self.download_codec = "fp32"
        #: With a lossy downlink: the outer step's own copy of the parameters (flat bytes).
        self._true: torch.Tensor | None = None
        #: ``wire.checksum`` of the payload as it stands; None until computed for this round.
        self._checksum: str | None = None
        self._summing: asyncio.Task[None] | None = None
        #: Full downloads wait for the checksum instead of going without (a lossy downlink,
        #: whose replicas check it; it is computed with each round, so this waits only once).
        self.checksum_required = False
        self._header = self._make_header()
        self._idle = asyncio.Event()
        self._idle.set()
        self._pending: Publication | None = None  # a round being published as it is written
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

    def _views(self, buffer: PayloadBuffer) -> list[torch.Tensor]:
        views = tensor_views(self.layout, buffer.payload)
        return [views[s.name] for s in self.specs]

    def _make_header(self, round: int | None = None) -> bytes:
        meta = {
            "round": str(self.round if round is None else round),
            "instance": self.instance,
            "kind": "global_params",
            "download_codec": self.download_codec,
        }
        # A header made before its round's payload is final (a streamed round) has none.
        if self._checksum is not None and round in (None, self.round):
            meta["checksum"] = self._checksum
        if self.header_meta is not None:
            meta.update(self.header_meta())
        return build_layout(self.specs, meta).header

    def refresh_header(self) -> None:
        self._header = self._make_header()

    def named(self) -> dict[str, torch.Tensor]:
        """The parameters the outer optimizer steps (the true copy, with a lossy downlink)."""
        return {s.name: p.data for s, p in zip(self.specs, self.params, strict=True)}

    def published(self) -> dict[str, torch.Tensor]:
        """Views of the published payload: what downloads serve and the workers hold."""
        if self._true is None:
            return self.named()
        return dict(zip([s.name for s in self.specs], self._views(self._buffer), strict=True))

    @property
    def payload(self) -> torch.Tensor:
        """The published payload's bytes (flat uint8; moves with copy-on-write)."""
        return self._buffer.payload

    def copy_out(self) -> dict[str, torch.Tensor]:
        """Copies of the published parameters."""
        return {name: t.clone() for name, t in self.published().items()}

    def copy_true(self) -> dict[str, torch.Tensor]:
        """Copies of the parameters the outer optimizer steps."""
        return {name: t.clone() for name, t in self.named().items()}

    @property
    def has_true(self) -> bool:
        return self._true is not None

    def keep_true(self, values: Mapping[str, torch.Tensor] | None = None) -> None:
        """Give the outer step a copy of the parameters of its own (a lossy downlink), equal to
        the published ones or to ``values`` (a checkpoint's true copy, checked against the
        table). Call before any step (blocking: one copy of the model)."""
        if values is not None:
            got = {n: tuple(t.shape) for n, t in values.items()}
            if got != self.table:
                raise ValueError("the true parameters do not match the parameter table")
        self._true = self._buffer.payload.clone()
        views = tensor_views(self.layout, self._true)
        with torch.no_grad():
            for s, p in zip(self.specs, self.params, strict=True):
                p.data = views[s.name]
                if values is not None:
                    p.data.copy_(values[s.name])
        if self.on_new_buffer is not None:
            self.on_new_buffer()

    @property
    def nbytes(self) -> int:
        return self.layout.payload_size

    @property
    def numel(self) -> int:
        return sum(s.numel for s in self.specs)

    # --- readers --------------------------------------------------------------------------

    async def open_snapshot(self) -> Snapshot:
        """Pin the current round's bytes. While an outer step is being applied, the round it
        is writing if that is being published as it goes, else wait for the step to end."""
        pending = self._pending
        if pending is not None and not pending.failed:
            buf = pending.buffer
            buf.readers += 1
            return Snapshot(
                pending.round, pending.header, byte_view(buf.payload), buf, ready=pending.until
            )
        while True:
            await self._idle.wait()
            if self._checksum is None:
                summing = self._start_checksum()
                if self.checksum_required:
                    await asyncio.shield(summing)
                    continue  # a step may have begun meanwhile
            buf = self._buffer
            buf.readers += 1
            return Snapshot(self.round, self._header, byte_view(buf.payload), buf)

    async def settled(self) -> None:
        """Wait until no outer step is being applied. Whatever is pinned before the next await
        belongs to one published round (a step clears this before it changes anything)."""
        await self._idle.wait()

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
        """Wait until the published round reaches ``min_round``, or a round that does is being
        published as it is written (``open_snapshot`` then streams it). False on timeout."""

        def reached() -> bool:
            pending = self._pending
            if pending is not None and not pending.failed and pending.round >= min_round:
                return True
            return self.round >= min_round

        return await self.wait_until(reached, timeout)

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
        fn: Callable[[PieceDone | None], None],
        *,
        new_round: int | None = None,
        on_publish: Callable[[], None] | None = None,
        stream: bool = False,
    ) -> None:
        """Run ``fn`` (which mutates ``self.params`` in place) off the event loop, then publish.
        ``on_publish`` runs on the loop just before waiters are woken (to move round counters
        that their predicates read).

        ``fn`` is handed a progress callback, or None. With ``stream`` (and a ``new_round``) it
        gets one, ``(param, n)``: the first n elements of that parameter are final; downloads
        of the new round then start at once and send what is final (``Publication``).
        Otherwise readers that arrive meanwhile wait. Readers already streaming keep the old
        bytes either way."""
        self._idle.clear()
        pending: Publication | None = None
        try:
            if self._summing is not None:
                await asyncio.shield(self._summing)  # it reads the payload about to change
            self._checksum = None  # ``fn`` may note the new one (a lossy downlink does)
            if self._buffer.readers:
                await asyncio.to_thread(self._copy_on_write)
            if stream and new_round is not None and self.header_meta is None:
                pending = Publication(
                    new_round,
                    self._make_header(new_round),
                    self._buffer,
                    self.layout.offsets,
                    asyncio.get_running_loop(),
                )
                self._pending = pending
                async with self._round_changed:
                    self._round_changed.notify_all()  # long polls for the new round go now
            await asyncio.to_thread(fn, pending.report if pending is not None else None)
            if new_round is not None:
                self.round = new_round
            if on_publish is not None:
                on_publish()
            self._header = self._make_header()
            if pending is not None:
                pending.complete()
        except BaseException:
            if pending is not None:
                pending.fail()  # the step raised: cut off whoever streams it
            raise
        finally:
            self._pending = None
            self._idle.set()
        if self._checksum is None and self.header_meta is None:
            # Computed at once, beside the downloads, not in the round's critical path; with
            # fragments only once a full download asks (they are rare there, updates are not).
            self._start_checksum()
        async with self._round_changed:
            self._round_changed.notify_all()

    # --- checksum -------------------------------------------------------------------------

    @property
    def checksum(self) -> str | None:
        """``wire.checksum`` of the published payload; None until computed for this round."""
        return self._checksum

    def note_checksum(self, value: str) -> None:
        """From ``update``'s ``fn``: the checksum of the payload as ``fn`` leaves it (a lossy
        downlink computes it with the round's update, which carries it too)."""
        self._checksum = value

    def _start_checksum(self) -> asyncio.Task[None]:
        if self._summing is None:
            self._summing = asyncio.get_running_loop().create_task(self._compute_checksum())
        return self._summing

    async def _compute_checksum(self) -> None:
        try:
            value = await asyncio.to_thread(checksum, [byte_view(self._buffer.payload)])
        finally:
            self._summing = None
        # ``update`` waits for this before it changes the payload: the value is still current.
        self._checksum = value
        self._header = self._make_header()

    def _copy_on_write(self) -> None:
        fresh = PayloadBuffer(self._buffer.payload.clone())
        if self._true is None:  # else the outer step's parameters live in the true copy
            with torch.no_grad():
                for p, view in zip(self.params, self._views(fresh), strict=True):
                    p.data = view
        self._buffer = fresh
        self.copies_on_write += 1
        if self.on_new_buffer is not None:
            self.on_new_buffer()
