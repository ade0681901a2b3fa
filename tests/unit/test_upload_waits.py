"""How long uploads queue for a receive buffer: counted per round, shown in status, and said once
in the log when it takes a real share of a round. Driven through the coordinator with a fake
clock and in-memory bodies (the HTTP path to it is covered in tests/integration).

A round's first upload is written straight into the sum and takes no slot
(server/intake/first_write.py), so with one slot it is the third upload that queues."""

from __future__ import annotations

import asyncio
import logging

import pytest
import torch

from diloco.server.intake.upload_slots import SlotPool
from tests.helpers.aio import let_loop_run
from tests.helpers.clock import FakeClock
from tests.helpers.coordinator import WAIT, HeldBody, coordinator, submit, upload


def test_a_queued_upload_is_timed_shown_and_hinted_once(caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> None:
        clock = FakeClock()
        coord = coordinator(clock, 3)
        st = coord.status().to_json()
        assert (st["upload_slots"], st["uploads_waiting"]) == (1, 0)
        assert st["last_round_upload_wait_max_s"] is None

        first = HeldBody(upload("a", 0, 1.0), held=4)  # into the sum, 4 bytes short
        a = asyncio.ensure_future(submit(coord, first))
        await let_loop_run()
        second = HeldBody(upload("b", 0, 3.0), held=4)  # holds the one slot, 4 bytes short
        b = asyncio.ensure_future(submit(coord, second))
        await let_loop_run()
        c = asyncio.ensure_future(submit(coord, HeldBody(upload("c", 0, 5.0))))
        await let_loop_run()
        assert coord.status().to_json()["uploads_waiting"] == 1 and not c.done()
        clock.now += 3.0
        second.release.set()
        first.release.set()
        await asyncio.wait_for(asyncio.gather(a, b, c), WAIT)
        await coord.settle()

        st = coord.status().to_json()
        entry = st["update_log"][-1]
        assert entry["round"] == 0 and entry["round_time_s"] == 3.0
        assert (entry["upload_wait_s"], entry["upload_wait_max_s"]) == (3.0, 3.0)
        assert st["last_round_upload_wait_max_s"] == 3.0 and st["uploads_waiting"] == 0
        mean = (1.0 + 3.0 + 5.0) / 3
        expected = torch.full((4,), -0.7 * (mean + 0.9 * mean))
        torch.testing.assert_close(coord.store.params[0], expected)
        hints = [r for r in caplog.records if "upload_slots" in r.getMessage()]
        assert len(hints) == 1 and hints[0].levelno == logging.WARNING
        assert "waited 3.0 s of the round's 3.0 s" in hints[0].getMessage()

        # Round 1: the uploads do not overlap, so nobody waits; the hint is not repeated.
        clock.now += 10.0
        for worker in ("a", "b", "c"):
            await asyncio.wait_for(submit(coord, HeldBody(upload(worker, 1, 0.0))), WAIT)
        await coord.settle()
        entry = coord.status().to_json()["update_log"][-1]
        assert (entry["round"], entry["upload_wait_s"], entry["upload_wait_max_s"]) == (1, 0, 0)
        assert len([r for r in caplog.records if "upload_slots" in r.getMessage()]) == 1

    with caplog.at_level(logging.WARNING, logger="diloco"):
        asyncio.run(scenario())


def test_short_waits_get_no_hint(caplog: pytest.LogCaptureFixture) -> None:
    """A wait under a second, or under a quarter of the round, is not worth a word."""

    async def scenario() -> None:
        clock = FakeClock()
        coord = coordinator(clock, 3)
        clock.now += 20.0  # the round has been open 20 s when the uploads come
        held = [HeldBody(upload(w, 0, 1.0), held=4) for w in ("a", "b")]
        tasks = []
        for body in held:
            tasks.append(asyncio.ensure_future(submit(coord, body)))
            await let_loop_run()
        tasks.append(asyncio.ensure_future(submit(coord, HeldBody(upload("c", 0, 1.0)))))
        await let_loop_run()
        clock.now += 2.0  # > 1 s, but a tenth of the 22 s round
        for body in held:
            body.release.set()
        await asyncio.wait_for(asyncio.gather(*tasks), WAIT)
        await coord.settle()
        assert coord.status().to_json()["update_log"][-1]["upload_wait_max_s"] == 2.0
        assert not [r for r in caplog.records if "upload_slots" in r.getMessage()]

    with caplog.at_level(logging.WARNING, logger="diloco"):
        asyncio.run(scenario())


def test_the_pool_counts_waiters_and_times_each_wait() -> None:
    async def scenario() -> None:
        clock = FakeClock()
        pool = SlotPool(8, slots=1, clock=clock)
        got: list[float] = []

        async def second() -> None:
            async with pool.take() as lease:
                got.append(lease.waited_s)

        async with pool.take() as first:
            assert first.waited_s == 0.0  # the slot was free (created on first use)
            task = asyncio.ensure_future(second())
            await let_loop_run()
            assert pool.waiting == 1 and not got
            clock.now += 0.75
        await asyncio.wait_for(task, WAIT)
        assert got == [0.75] and pool.waiting == 0
        async with pool.take() as third:  # free again: no wait
            assert third.waited_s == 0.0

    asyncio.run(scenario())
