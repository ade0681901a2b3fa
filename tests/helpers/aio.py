"""Helpers for tests that drive an asyncio loop by hand."""

from __future__ import annotations

import asyncio

SPINS = 20


async def let_loop_run(spins: int = SPINS) -> None:
    """Give every ready callback and task a chance to run, ``spins`` loop turns over. Used
    before asserting that something has *not* happened: whatever could make it happen without
    outside help has had its turn."""
    for _ in range(spins):
        await asyncio.sleep(0)
