"""Late work merged, through the coordinator on a fake clock with in-memory bodies (the HTTP
path: tests/integration/test_quorum_rounds.py): a round that closes on its quorum while an
upload's body is still arriving merges that upload into the next round with its staleness
weight, exactly once, and the parameters are the hand-computed ones."""

from __future__ import annotations

import asyncio
import math

import torch

from diloco.server.errors import ApiError
from diloco.server.observe.metrics import render
from diloco.wire.messages import Register, RegisterInfo
from tests.helpers.aio import let_loop_run
from tests.helpers.clock import FakeClock
from tests.helpers.coordinator import WAIT, HeldBody, coordinator, submit, upload

LR, MU = 0.7, 0.9  # the default outer SGD with Nesterov momentum


def nesterov(grads: list[float]) -> float:
    """The parameter after outer steps on these mean pseudo-gradients (from 0)."""
    w, buf = 0.0, 0.0
    for g in grads:
        buf = MU * buf + g
        w -= LR * (g + MU * buf)
    return w


def test_a_round_closing_mid_upload_merges_the_upload_into_the_next_round() -> None:
    async def scenario() -> None:
        clock = FakeClock()
        # Two slots: the held body keeps one while the others land through the other.
        coord = coordinator(clock, 3, quorum="2", grace="0", upload_slots=2)
        held = HeldBody(upload("c", 0, 5.0), held=4)  # c's body, 4 bytes short
        c = asyncio.ensure_future(submit(coord, held))
        await let_loop_run()
        assert coord.status().uploading == ("c",)
        await asyncio.wait_for(submit(coord, HeldBody(upload("a", 0, 1.0))), WAIT)
        await asyncio.wait_for(submit(coord, HeldBody(upload("b", 0, 3.0))), WAIT)
        await coord.settle()  # the quorum (a, b) and a grace of 0: round 0 closed without c
        assert coord.store is not None and coord.store.round == 1
        torch.testing.assert_close(coord.store.params[0], torch.full((4,), nesterov([2.0])))
        assert not c.done()

        held.release.set()  # c's last bytes land in round 1
        receipt = await asyncio.wait_for(c, WAIT)
        w = 1 / math.sqrt(2)
        assert receipt["status"] == "accepted" and receipt["round"] == 1
        assert receipt["late"] == 1 and receipt["weight"] == w
        again = await asyncio.wait_for(submit(coord, HeldBody(upload("c", 0, 5.0))), WAIT)
        assert (again["status"], again["round"]) == ("duplicate", 1)  # a retry counts once

        # Round 1 holds c's late upload: a's makes its quorum (grace 0), so it closes, and
        # b's upload against round 1 is merged late into round 2 in turn.
        await asyncio.wait_for(submit(coord, HeldBody(upload("a", 1, 1.0))), WAIT)
        await coord.settle()
        st = coord.status()
        assert st.round == 2 and st.update_log[-1].contributions == 2
        g1 = (w * 5.0 + 1.0) / (w + 1)
        torch.testing.assert_close(coord.store.params[0], torch.full((4,), nesterov([2.0, g1])))
        b = await asyncio.wait_for(submit(coord, HeldBody(upload("b", 1, 1.0))), WAIT)
        assert (b["round"], b["late"]) == (2, 1)
        quorum = coord.status().to_json()["quorum_rounds"]
        assert quorum["size"] == 2 and quorum["grace"] == "0" and quorum["max_lateness"] == 1
        assert quorum["late_merges"] == [
            {"round": 1, "base": 0, "worker_id": "c", "weight": round(w, 6)},
            {"round": 2, "base": 1, "worker_id": "b", "weight": round(w, 6)},
        ]
        assert quorum["late_merges_total"] == 2 and quorum["grace_s"] is None  # round 2: no quorum
        metrics = render(coord.status()).splitlines()
        assert "diloco_late_merges_total 2" in metrics
        assert not [line for line in metrics if line.startswith("diloco_grace_seconds ")]

    asyncio.run(scenario())


def test_an_upload_later_than_max_lateness_is_refused_and_counts_nothing() -> None:
    async def scenario() -> None:
        clock = FakeClock()
        coord = coordinator(clock, 3, quorum="2", grace="0", upload_slots=2)
        held = HeldBody(upload("c", 0, 5.0), held=4)
        c = asyncio.ensure_future(submit(coord, held))
        await let_loop_run()
        for r in (0, 1):  # two rounds close while c's body arrives
            for worker in ("a", "b"):
                await asyncio.wait_for(submit(coord, HeldBody(upload(worker, r, 1.0))), WAIT)
            await coord.settle()
        assert coord.store is not None and coord.store.round == 2
        held.release.set()
        try:
            await asyncio.wait_for(c, WAIT)
            raise AssertionError("counted")
        except ApiError as exc:
            assert (exc.status, exc.code) == (409, "stale_round")
            assert exc.reply.action == "rebase"
        st = coord.status()
        assert st.uploading == () and st.submitted == ()
        assert st.to_json()["quorum_rounds"]["late_merges"] == []

    asyncio.run(scenario())


def test_the_timer_closes_the_round_when_the_grace_ends() -> None:
    """With a grace window the round waits; the aggregator's timer wakes the coordinator at the
    deadline (here the fake clock is moved and the wake called, as the timer does)."""

    async def scenario() -> None:
        clock = FakeClock()
        coord = coordinator(clock, 3, quorum="2", grace="5")
        for worker in ("a", "b"):
            await asyncio.wait_for(submit(coord, HeldBody(upload(worker, 0, 1.0))), WAIT)
        await let_loop_run()
        assert coord.store is not None and coord.store.round == 0
        assert coord.status().to_json()["quorum_rounds"]["grace_s"] == 5.0
        clock.now += 4.0
        coord.wake()
        await coord.settle()
        assert coord.store.round == 0
        clock.now += 1.0
        coord.wake()
        await coord.settle()
        assert coord.store.round == 1

    asyncio.run(scenario())


def test_a_streaming_worker_is_told_at_registration_that_quorum_rounds_keep_one_unit() -> None:
    """Quorum rounds are refused with streaming fragments: a server with ``--quorum`` fixes one
    unit, so a streaming worker gets 409 fragments_mismatch (reconfigure) when it registers,
    before it is counted anywhere."""
    clock = FakeClock()
    coord = coordinator(clock, 3, quorum="2")
    try:
        coord.membership.register(Register("d", info=RegisterInfo(num_fragments=2)), "h")
        raise AssertionError("registered")
    except ApiError as exc:
        assert (exc.status, exc.code, exc.reply.action) == (
            409,
            "fragments_mismatch",
            "reconfigure",
        )
    assert "d" not in coord.registry.ids()
