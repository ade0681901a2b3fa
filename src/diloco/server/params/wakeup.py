"""Waiting on the event loop for a value that other callbacks move forward."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class Wakeup:
    """Wakes every waiter each time ``notify`` is called; a waiter sleeps again until its own
    condition holds. For progress marks (bytes received, read, written) that move in many small
    steps while each waiter needs its own threshold. Event loop thread only."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def notify(self) -> None:
        self._event.set()

    async def until(self, condition: Callable[[], bool]) -> None:
        """Return once ``condition()`` holds (checked now and after every ``notify``)."""
        while not condition():
            self._event.clear()
            await self._event.wait()
