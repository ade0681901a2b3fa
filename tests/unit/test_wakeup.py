"""Wakeup: each waiter returns once its own condition holds, and not before."""

from __future__ import annotations

import asyncio

from diloco.server.params.wakeup import Wakeup
from tests.helpers.aio import let_loop_run

WAIT = 5.0


def test_waiters_return_at_their_own_thresholds() -> None:
    async def scenario() -> None:
        wakeup, mark = Wakeup(), [0]
        low = asyncio.ensure_future(wakeup.until(lambda: mark[0] >= 2))
        high = asyncio.ensure_future(wakeup.until(lambda: mark[0] >= 5))
        mark[0] = 1
        wakeup.notify()
        await let_loop_run()
        assert not low.done() and not high.done()
        mark[0] = 3
        wakeup.notify()
        await asyncio.wait_for(low, WAIT)
        await let_loop_run()
        assert not high.done()  # woken, checked, asleep again
        mark[0] = 5
        wakeup.notify()
        await asyncio.wait_for(high, WAIT)
        await asyncio.wait_for(wakeup.until(lambda: True), WAIT)  # holds already: no wait

    asyncio.run(scenario())
