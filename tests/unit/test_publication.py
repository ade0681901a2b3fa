"""A round published while its outer step writes it: downloads get only final bytes."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from diloco.server.params.store import ParamStore
from tests.helpers.aio import let_loop_run

WAIT = 5.0


def _store() -> ParamStore:
    # Three fp32 tensors back to back: bytes [0, 16), [16, 24), [24, 36).
    return ParamStore.from_tensors({"a": torch.zeros(4), "b": torch.zeros(2), "c": torch.zeros(3)})


async def _ready_after(store: ParamStore, *reports: tuple[int, int]) -> int:
    """The ready mark of a fresh publication after the given (param index, elements) reports."""
    reported, release = threading.Event(), threading.Event()

    def step(progress: object) -> None:
        assert callable(progress)
        for i, elements in reports:
            progress(store.params[i], elements)
        reported.set()
        assert release.wait(WAIT)

    task = asyncio.ensure_future(store.update(step, new_round=1, stream=True))
    # The reports reach the loop as callbacks queued before `reported` was set, so they have
    # run by the time this wait's own completion callback does.
    assert await asyncio.to_thread(reported.wait, WAIT)
    pending = store._pending
    assert pending is not None
    ready = pending.ready
    release.set()
    await asyncio.wait_for(task, WAIT)
    return ready


@pytest.mark.parametrize(
    ("reports", "ready"),
    [
        ([], 0),
        ([(0, 2)], 8),  # half of a
        ([(0, 4)], 16),  # a in full
        ([(1, 2)], 0),  # b first: nothing before it is final, so nothing is ready
        ([(1, 2), (0, 4)], 24),  # then a: a and b
        ([(0, 4), (1, 2), (2, 3)], 35),  # everything written: the last byte waits for publication
    ],
)
def test_ready_is_the_final_prefix_and_holds_back_the_last_byte(
    reports: list[tuple[int, int]], ready: int
) -> None:
    assert asyncio.run(_ready_after(_store(), *reports)) == ready


def test_a_download_during_the_step_streams_the_new_round_only_as_it_becomes_final() -> None:
    async def scenario() -> None:
        store = _store()
        half, release = threading.Event(), threading.Event()

        def step(progress: object) -> None:
            assert callable(progress)
            store.params[0].data.fill_(1.0)
            progress(store.params[0], 4)
            half.set()
            assert release.wait(WAIT)
            store.params[1].data.fill_(2.0)
            store.params[2].data.fill_(3.0)
            progress(store.params[1], 2)
            progress(store.params[2], 3)

        update = asyncio.ensure_future(store.update(step, new_round=1, stream=True))
        assert await asyncio.to_thread(half.wait, WAIT)
        assert await store.wait_for_round(1, WAIT)  # long polls for round 1 end at once
        snap = await store.open_snapshot()
        assert snap.round == 1 and store.round == 0 and snap.ready is not None
        await asyncio.wait_for(snap.ready(16), WAIT)
        assert (
            torch.frombuffer(bytearray(snap.payload[:16]), dtype=torch.float32).tolist()
            == [1.0] * 4
        )
        rest = asyncio.ensure_future(snap.ready(36))
        await let_loop_run()
        assert not rest.done()  # b and c are not written yet
        release.set()
        await asyncio.wait_for(rest, WAIT)
        await asyncio.wait_for(update, WAIT)
        assert store.round == 1
        values = torch.frombuffer(bytearray(snap.payload), dtype=torch.float32).tolist()
        assert values == [1.0] * 4 + [2.0] * 2 + [3.0] * 3
        ParamStore.close_snapshot(snap)

    asyncio.run(scenario())


def test_a_failed_step_cuts_off_its_downloads_and_publishes_nothing() -> None:
    async def scenario() -> None:
        store = _store()
        started, release = threading.Event(), threading.Event()

        def step(progress: object) -> None:
            assert callable(progress)
            progress(store.params[0], 4)
            started.set()
            assert release.wait(WAIT)
            raise RuntimeError("out of memory, say")

        update = asyncio.ensure_future(store.update(step, new_round=1, stream=True))
        assert await asyncio.to_thread(started.wait, WAIT)
        snap = await store.open_snapshot()
        assert snap.round == 1 and snap.ready is not None
        waiting = asyncio.ensure_future(snap.ready(36))
        release.set()
        with pytest.raises(RuntimeError, match="out of memory"):
            await asyncio.wait_for(update, WAIT)
        with pytest.raises(RuntimeError, match="outer step of round 1 failed"):
            await asyncio.wait_for(waiting, WAIT)
        ParamStore.close_snapshot(snap)
        assert store.round == 0
        # Later downloads wait for a round that really is published; none is pending now.
        assert not await store.wait_for_round(1, 0.01)

    asyncio.run(scenario())


def test_without_stream_readers_wait_for_the_whole_step() -> None:
    async def scenario() -> None:
        store = _store()
        started, release = threading.Event(), threading.Event()

        def step(progress: object) -> None:
            assert progress is None
            started.set()
            assert release.wait(WAIT)
            store.params[0].data.fill_(5.0)

        update = asyncio.ensure_future(store.update(step, new_round=1))
        assert await asyncio.to_thread(started.wait, WAIT)
        opening = asyncio.ensure_future(store.open_snapshot())
        await let_loop_run()
        assert not opening.done()
        release.set()
        snap = await asyncio.wait_for(opening, WAIT)
        await asyncio.wait_for(update, WAIT)
        assert snap.round == 1 and snap.ready is None
        assert torch.frombuffer(bytearray(snap.payload[:4]), dtype=torch.float32).item() == 5.0
        ParamStore.close_snapshot(snap)

    asyncio.run(scenario())
