"""A server restarted in the middle of a quorum round's grace window (``--save-every 1``) goes
on as the durability rules say (docs/design/durability.md; docs/design/server-mode.md,
"Quorum rounds"): the checkpoint holds the closed rounds and their receipts, a late merge
counted only in the open round is not in it and is said not counted to its re-registering
worker, which sends it again; the resumed round waits for its quorum afresh, and the run ends
with the same parameters as without the crash: every upload counted once."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import torch

from diloco.persistence import latest_checkpoint
from diloco.server.paramserver.coordinator import SyncCoordinator
from diloco.wire.messages import Register
from tests.helpers.clock import FakeClock
from tests.helpers.coordinator import WAIT, HeldBody, coordinator, submit, upload

W = 1 / math.sqrt(2)


def expected_after_round_1() -> float:
    """Outer SGD, lr 0.7, Nesterov 0.9: round 0 averages a 1 and b 3; round 1 c's late 5 (weight
    1/sqrt 2) and a's 1."""
    g0, g1 = 2.0, (W * 5.0 + 1.0) / (W + 1.0)
    buf = g0
    w = -0.7 * (g0 + 0.9 * buf)
    buf = 0.9 * buf + g1
    return w - 0.7 * (g1 + 0.9 * buf)


def test_a_restart_mid_grace_loses_nothing_and_counts_nothing_twice(tmp_path: Path) -> None:
    async def scenario() -> None:
        clock = FakeClock()
        settings = {"quorum": "2", "grace": "5", "save_dir": str(tmp_path), "save_every": 1}
        coord = coordinator(clock, 3, **settings)
        for worker, value in (("a", 1.0), ("b", 3.0)):
            await asyncio.wait_for(submit(coord, HeldBody(upload(worker, 0, value))), WAIT)
        clock.now += 5.0
        coord.wake()
        await coord.settle()  # round 0 closed without c, saved as round 1
        late = await asyncio.wait_for(submit(coord, HeldBody(upload("c", 0, 5.0))), WAIT)
        assert (late["round"], late["late"]) == (1, 1)
        await asyncio.wait_for(submit(coord, HeldBody(upload("a", 1, 1.0))), WAIT)
        assert coord.status().to_json()["quorum_rounds"]["grace_s"] == 5.0  # mid-grace: crash

        ckpt = latest_checkpoint(tmp_path)
        assert ckpt is not None and ckpt.round == 1
        again = SyncCoordinator(coord.config, None, clock=clock)
        again.restore(ckpt)
        replies = {
            w: again.membership.register(Register(w, last_submission_id=sid), "h")
            for w, sid in (("a", "a-1"), ("b", "b-0"), ("c", "c-0"))
        }
        for w in ("a", "c"):  # counted only in the open round: not in the checkpoint
            last = replies[w].last_submission
            assert last is not None and last.counted_in is None
        last = replies["b"].last_submission
        assert last is not None and (last.counted_in, last.in_params) == (0, True)
        st = again.status().to_json()
        assert (st["round"], st["opened"], st["submitted"]) == (1, True, [])
        assert st["quorum_rounds"]["grace_s"] is None  # the quorum is waited for afresh

        # The workers send again under the same ids: each counts once, c's still late.
        resent = await asyncio.wait_for(submit(again, HeldBody(upload("c", 0, 5.0))), WAIT)
        assert (resent["status"], resent["round"], resent["late"]) == ("accepted", 1, 1)
        dup = await asyncio.wait_for(submit(again, HeldBody(upload("c", 0, 5.0))), WAIT)
        assert (dup["status"], dup["round"]) == ("duplicate", 1)
        await asyncio.wait_for(submit(again, HeldBody(upload("a", 1, 1.0))), WAIT)
        await again.settle()
        assert again.store is not None and again.store.round == 1  # in its grace window
        clock.now += 5.0
        again.wake()
        await again.settle()
        assert again.store.round == 2
        want = torch.full((4,), expected_after_round_1())
        torch.testing.assert_close(again.store.params[0], want)

    asyncio.run(scenario())
