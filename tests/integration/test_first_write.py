"""The round's first upload goes straight into the running sum (server/intake/first_write.py): it
takes no upload slot, an add waits for it, and one that fails midway leaves a sum that counts
nothing, so the next upload is the first again. Driven through the coordinator with in-memory bodies
and two-element stages, so every body here spans several stretches."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest
import torch

import diloco.server.intake.first_write as first_write
from diloco.core.accumulate import WeightedSum
from diloco.server.errors import ApiError
from diloco.server.intake.first_write import FirstWrite, Stages
from diloco.wire import WireError, build_layout, spec_of
from tests.helpers.aio import let_loop_run
from tests.helpers.clock import FakeClock
from tests.helpers.coordinator import WAIT, HeldBody, coordinator, submit, upload

LR, MOMENTUM = 0.7, 0.9


def first_step(mean: torch.Tensor) -> torch.Tensor:
    """Parameters after the first outer step from zeros (Nesterov: the buffer is the mean)."""
    return -LR * (mean + MOMENTUM * mean)


async def eventually(condition: Callable[[], bool]) -> None:
    """Wait (bounded) for something a worker thread brings about: no event marks it."""
    deadline = time.monotonic() + WAIT
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.001)


class CutBody(HeldBody):
    """A body that ends (the sender went away) after ``keep`` bytes."""

    def __init__(self, data: bytes, keep: int) -> None:
        super().__init__(data[:keep])


@pytest.fixture(autouse=True)
def small_stages(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(first_write, "STAGE_BYTES", 8)  # two fp32 elements a stretch


def test_the_first_upload_takes_no_slot_and_the_next_add_waits_for_it() -> None:
    async def scenario() -> None:
        coord = coordinator(FakeClock(), 2)
        first = HeldBody(upload("a", 0, 1.0), held=4)
        a = asyncio.ensure_future(submit(coord, first))
        await let_loop_run()
        # b lands whole in the one slot while a is still arriving, and counts at once ...
        b = asyncio.ensure_future(submit(coord, HeldBody(upload("b", 0, 3.0))))
        await eventually(lambda: coord.status().to_json()["submitted"] == ["b"])
        await let_loop_run()
        st = coord.status().to_json()
        assert st["uploading"] == ["a"]
        assert st["uploads_waiting"] == 0
        assert not b.done()  # ... but its add waits for a's write to the sum
        assert coord.units[0].sum.count == 0
        first.release.set()
        replies = await asyncio.wait_for(asyncio.gather(a, b), WAIT)
        assert [r["status"] for r in replies] == ["accepted", "accepted"]
        await coord.settle()
        assert coord.status().to_json()["round"] == 1
        torch.testing.assert_close(coord.store.params[0], first_step(torch.full((4,), 2.0)))

    asyncio.run(scenario())


def cut_body() -> HeldBody:
    """Its first stretch (huge values) reaches the sum, then the sender goes away."""
    data = upload("a", 0, torch.tensor([1000.0, 1000.0, 1.0, 1.0]))
    return CutBody(data, len(data) - 8)


def non_finite_body() -> HeldBody:
    """Its first stretch reaches the sum; the second holds a NaN."""
    return HeldBody(upload("a", 0, torch.tensor([5.0, 5.0, float("nan"), 1.0])))


@pytest.mark.parametrize(
    ("body", "error", "status", "code"),
    [(cut_body, WireError, None, "truncated"), (non_finite_body, ApiError, 422, "non_finite")],
    ids=["cut", "non_finite"],
)
def test_a_first_upload_that_fails_midway_counts_nothing(
    body: Callable[[], HeldBody], error: type[Exception], status: int | None, code: str
) -> None:
    """Part of the failed body reached the sum; the next upload overwrites it as the first
    contribution, and the failed one counts only when it is sent again whole."""

    async def scenario() -> None:
        coord = coordinator(FakeClock(), 2)
        with pytest.raises(error) as refused:
            await submit(coord, body())
        assert refused.value.code == code  # type: ignore[attr-defined]
        if status is not None:
            assert refused.value.status == status  # type: ignore[attr-defined]
        st = coord.status().to_json()
        assert (st["submitted"], st["uploading"], coord.units[0].sum.count) == ([], [], 0)
        await asyncio.wait_for(submit(coord, HeldBody(upload("b", 0, 3.0))), WAIT)
        await asyncio.wait_for(submit(coord, HeldBody(upload("a", 0, 1.0))), WAIT)
        await coord.settle()
        torch.testing.assert_close(coord.store.params[0], first_step(torch.full((4,), 2.0)))

    asyncio.run(scenario())


def test_the_first_write_of_a_worker_that_left_is_refused_and_the_round_closes_without_it() -> None:
    async def scenario() -> None:
        coord = coordinator(FakeClock(), 2)
        first = HeldBody(upload("a", 0, 1000.0), held=4)
        a = asyncio.ensure_future(submit(coord, first))
        await let_loop_run()
        coord.membership.deregister("a")  # a leaves mid-upload: the round now waits for b alone
        b = asyncio.ensure_future(submit(coord, HeldBody(upload("b", 0, 3.0))))
        await eventually(lambda: coord.status().to_json()["submitted"] == ["b"])
        await let_loop_run()
        assert not b.done()  # its add waits for a's write to end
        first.release.set()
        with pytest.raises(ApiError) as gone:
            await asyncio.wait_for(a, WAIT)
        assert gone.value.status == 410
        assert (await asyncio.wait_for(b, WAIT))["status"] == "accepted"
        await coord.settle()
        assert coord.status().to_json()["last_round_contributions"] == 1
        torch.testing.assert_close(coord.store.params[0], first_step(torch.full((4,), 3.0)))

    asyncio.run(scenario())


def test_write_first_gives_the_bits_of_add() -> None:
    gen = torch.Generator().manual_seed(3)
    shapes = [(3, 5), (7,)]
    values = [torch.randn(s, generator=gen).to(torch.bfloat16) for s in shapes]
    by_add, by_pieces = WeightedSum(shapes), WeightedSum(shapes)
    by_add.add(values, 0.3)
    for i, v in enumerate(values):  # ragged pieces, out of order
        flat = v.reshape(-1)
        for start in reversed(range(0, flat.numel(), 4)):
            by_pieces.write_first(i, start, flat[start : start + 4], 0.3)
    assert by_pieces.count == 0  # nothing counts before the commit
    by_pieces.commit_first(0.3)
    assert (by_pieces.count, by_pieces.total_weight) == (1, 0.3)
    for x, y in zip(by_add.sums, by_pieces.sums, strict=True):
        assert torch.equal(x, y)


def test_write_first_refuses_what_would_break_the_sum() -> None:
    wsum = WeightedSum([(4,)])
    with pytest.raises(ValueError, match="outside"):
        wsum.write_first(0, 3, torch.ones(2), 1.0)
    with pytest.raises(ValueError, match="positive"):
        wsum.write_first(0, 0, torch.ones(2), 0.0)
    wsum.add([torch.ones(4)], 1.0)
    with pytest.raises(ValueError, match="first contribution"):
        wsum.write_first(0, 0, torch.ones(2), 1.0)
    with pytest.raises(ValueError, match="already counts"):
        wsum.commit_first(1.0)
    assert torch.equal(wsum.sums[0], torch.ones(4)) and wsum.count == 1


def test_stretches_stay_inside_one_tensor_and_hold_whole_elements() -> None:
    layout = build_layout(
        [spec_of("h", torch.zeros(5, dtype=torch.bfloat16)), spec_of("f", torch.zeros(3))]
    )
    fw = FirstWrite(WeightedSum([(5,), (3,)]), ["h", "f"], layout, 1.0, Stages(6), "a")
    got = [(i, name, start, nbytes) for i, name, _, start, nbytes in fw.stretches()]
    # Payload order puts the fp32 tensor first; 6-byte stages hold one fp32 or three bf16.
    assert got == [
        (1, "f", 0, 4),
        (1, "f", 1, 4),
        (1, "f", 2, 4),
        (0, "h", 0, 6),
        (0, "h", 3, 4),
    ]
