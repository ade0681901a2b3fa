"""A relay's rounds: the sync barrier and running sum of ``SyncAggregator`` unchanged (its
region's workers see an ordinary sync server), but closing a round steps no outer optimizer
here. The round's weighted mean is written down (``relay/pending.py``, with a save dir), goes
upstream as one upload, and the upstream's next parameters are published as the next round,
with the checkpoint it owes first (``Checkpoints.publish``).
"""

from __future__ import annotations

import asyncio
import logging

import torch

from diloco.core.outer import PieceDone
from diloco.server.relay import pending as on_disk
from diloco.server.relay.pending import Pending
from diloco.server.relay.upstream import Upstream
from diloco.server.rounds.outer_steps import OuterSteps
from diloco.server.rounds.sync_aggregator import SyncAggregator
from diloco.server.rounds.units import Unit

log = logging.getLogger(__name__)


class RelayAggregator(SyncAggregator):
    """The whole model's rounds of a relay (``Aggregator``)."""

    def __init__(self, unit: Unit, steps: OuterSteps, round_: int, upstream: Upstream) -> None:
        super().__init__(unit, steps, round_)
        self.upstream = upstream

    async def close(self, round_: int) -> None:
        steps, unit = self.steps, self.unit
        wsum = unit.sum
        async with steps.lock:
            await steps.sum_free(unit)  # a first write whose worker left mid-upload
            t0 = steps.clock()
            count, total = wsum.count, wsum.total_weight
            assert count and total > 0, "a sync round closes with at least one contribution"
            assert self.upstream.round is not None, "a relay holds parameters of an upstream round"

            def mean() -> dict[str, torch.Tensor]:
                for s in wsum.sums:  # the sum is reset after the round: divide it in place
                    s.div_(total)
                return dict(zip(unit.names, wsum.sums, strict=True))

            receipts = tuple(sid for sid, r in self.barrier.history.items() if r == round_)
            closed = Pending(
                round_, self.upstream.round, total, count, receipts, await asyncio.to_thread(mean)
            )
            if steps.config.save_dir is not None:
                await asyncio.to_thread(on_disk.write, steps.config.save_dir, closed)
            await self._send(closed, t0)

    async def resume(self, closed: Pending) -> None:
        """A restarted relay's round that closed before it died (its receipts restored and the
        barrier closing since ``RelayCoordinator.restore``): send its mean again, under the same
        id, and publish the result."""
        assert self.barrier.round == closed.relay_round and self.barrier.closing
        async with self.steps.lock:
            log.info(
                "relay: round %d closed before the restart; sending it again", closed.relay_round
            )
            await self._send(closed, self.steps.clock())

    async def _send(self, closed: Pending, t0: float) -> None:
        """Under the tensor lock: the upload, the wait for the upstream's answer, publication.
        The lock is held while the upstream answers: nothing else may touch the sum or the
        parameters meanwhile, and the next round cannot open before its result."""
        steps, unit, barrier, round_ = self.steps, self.unit, self.barrier, closed.relay_round
        wsum = unit.sum
        self.upstream.region = len(steps.live())
        up_round, params = await asyncio.to_thread(
            self.upstream.exchange,
            round_,
            closed.base,
            unit.names,
            [closed.mean[n] for n in unit.names],
            closed.weight,
        )

        def adopt(progress: PieceDone | None) -> None:
            with torch.no_grad():
                for p, name in zip(unit.params, unit.names, strict=True):
                    p.copy_(params[name])
                    if progress is not None:
                        progress(p, p.numel())
            wsum.reset()

        await steps.checkpoints.publish(
            unit, round_ + 1, adopt, before=lambda: barrier.advance(steps.live())
        )
        if steps.config.save_dir is not None:
            await asyncio.to_thread(on_disk.discard, steps.config.save_dir)
        outer_s = steps.clock() - t0
        run_log = steps.run_log
        run_log.last_round_contributions = closed.count
        entry = run_log.update(unit.index, round_, outer_s, closed.count, None, refused=False)
        run_log.hint_upload_slots(entry)
        log.info(
            "round %d closed: %d contributions (weight %.3g) sent upstream; round %d open with "
            "upstream round %d",
            round_,
            closed.count,
            closed.weight,
            round_ + 1,
            up_round,
        )
