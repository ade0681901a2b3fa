"""Driving the server's coordinator without HTTP: a coordinator on a fake clock, upload bodies
held in memory and released byte by byte, and submissions through it."""

from __future__ import annotations

import asyncio

import torch

from diloco.server.config import ServerConfig
from diloco.server.params.store import ParamStore
from diloco.server.paramserver.coordinator import SyncCoordinator
from diloco.wire import aread_layout, encode
from diloco.wire.messages import Register
from tests.helpers.clock import FakeClock

WAIT = 5.0


class HeldBody:
    """An upload body whose last ``held`` bytes arrive only once ``release`` is set."""

    def __init__(self, data: bytes, held: int = 0) -> None:
        self._data = data
        self._pos = 0
        self._stop = len(data) - held
        self.release = asyncio.Event()
        if not held:
            self.release.set()

    async def read(self, n: int = -1) -> bytes:
        if self._pos >= self._stop:
            await self.release.wait()
            self._stop = len(self._data)
        end = self._stop if n < 0 else min(self._stop, self._pos + n)
        part = self._data[self._pos : end]
        self._pos = end
        return part


def upload(worker: str, round_: int, value: float | torch.Tensor) -> bytes:
    meta = {"worker_id": worker, "base_round": str(round_), "submission_id": f"{worker}-{round_}"}
    t = value if isinstance(value, torch.Tensor) else torch.full((4,), value)
    return encode({"w": t}, meta)


def coordinator(clock: FakeClock, workers: int, **settings: object) -> SyncCoordinator:
    """A sync coordinator on ``clock`` with ``w = zeros(4)`` and workers a, b, c... registered;
    ``settings`` are more ``ServerConfig`` fields."""
    config = ServerConfig(
        port=0,
        num_workers=workers,
        heartbeat_timeout=0,
        stuck_timeout=0,
        **settings,  # type: ignore[arg-type]
    )
    coord = SyncCoordinator(config, ParamStore.from_tensors({"w": torch.zeros(4)}), clock=clock)
    for i in range(workers):
        coord.membership.register(Register("abc"[i]), "h")
    return coord


async def submit(coord: SyncCoordinator, body: HeldBody) -> dict[str, object]:
    layout = await aread_layout(body)
    return (await coord.submit(layout, body)).to_json()
