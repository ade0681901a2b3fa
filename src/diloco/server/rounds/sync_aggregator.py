"""Synchronous DiLoCo on one unit: the barrier (server/rounds/barrier.py) says who must submit and
when the round may close; the running sum collects the weighted uploads; closing the round is
one outer step on their weighted mean (or their robust mean), published as the next round.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import torch

from diloco.core.accumulate import Entry
from diloco.core.outer import PieceDone
from diloco.core.robust import robust_mean
from diloco.server.observe.records import State
from diloco.server.rounds.aggregator import Check, Landed
from diloco.server.rounds.barrier import SyncBarrier
from diloco.server.rounds.outer_steps import OuterSteps
from diloco.server.rounds.units import Unit
from diloco.wire.messages import UploadReceipt

log = logging.getLogger(__name__)


class SyncAggregator:
    """One unit's rounds (``Aggregator``)."""

    def __init__(self, unit: Unit, steps: OuterSteps, round_: int) -> None:
        self.unit = unit
        self.steps = steps
        config = steps.config
        self.barrier = SyncBarrier(steps.model.num_workers, config.min_workers, round=round_)
        #: With robust aggregation: the open round's uploads (weight, fp32 tensors).
        self._kept: list[tuple[float, list[torch.Tensor]]] = []

    @property
    def round(self) -> int:
        return self.barrier.round

    @property
    def history(self) -> Mapping[str, int]:
        return self.barrier.history

    @property
    def versioned(self) -> bool:
        return False

    def restore_receipt(self, submission_id: str, counted_in: int) -> None:
        self.barrier.history[submission_id] = counted_in

    # --- submissions ----------------------------------------------------------------------------

    def check(self, worker_id: str, base: int, submission_id: str) -> Check:
        return self.barrier.check(worker_id, base, submission_id)

    def begin_upload(self, worker_id: str, submission_id: str) -> None:
        self.barrier.begin_upload(worker_id, submission_id)

    def abort_upload(self, worker_id: str, submission_id: str) -> None:
        self.barrier.abort_upload(worker_id, submission_id)

    def is_current(self, worker_id: str, submission_id: str) -> bool:
        return self.barrier.uploading.get(worker_id) == submission_id

    def first_write(self) -> bool:
        # One unit only (fragments are small and arrive together), and not with robust
        # aggregation: the round keeps each upload whole, not a running sum.
        return (
            len(self.steps.model.units) == 1
            and not self.steps.config.robust
            and not self.unit.sum.count
        )

    def reads_late(self) -> bool:
        return False

    async def accept(self, landed: Landed) -> UploadReceipt:
        # From here on the submission counts: record it, then queue the addition on the tensor
        # lock before yielding, so a round close queued later sees it.
        self.barrier.record(landed.worker_id, landed.submission_id)
        if landed.written:
            self.unit.sum.commit_first(landed.weight)
        else:
            assert landed.add is not None and landed.sum_add is not None
            add = (
                self._keep(landed.tensors, landed.weight)
                if self.steps.config.robust
                else landed.sum_add
            )
            await landed.add(add)
        return UploadReceipt(status="accepted", round=landed.base)

    def _keep(self, entries: list[Entry], weight: float) -> Callable[[], None]:
        """Robust aggregation: the add of one landed body is an fp32 copy kept for the round's
        close (the median of the norms and the trimmed mean need every upload at once); an
        encoded upload is decoded into it, the same memory as a raw one's copy. It runs under
        the tensor lock, as adds do, so a close queued after it sees it."""

        def fp32(entry: Entry) -> torch.Tensor:
            if isinstance(entry, torch.Tensor):
                return entry.to(torch.float32, copy=True)
            out = torch.empty(entry.shape, dtype=torch.float32)
            entry.add_into(out, 1.0, first=True)  # decode, the arithmetic of the sum's adds
            return out

        def keep() -> None:
            self._kept.append((weight, [fp32(e) for e in entries]))

        return keep

    # --- closing --------------------------------------------------------------------------------

    def ready(self) -> bool:
        return self.barrier.ready()

    def begin_close(self) -> int:
        return self.barrier.begin_close()

    async def close(self, round_: int) -> None:
        steps, unit, barrier = self.steps, self.unit, self.barrier
        wsum = unit.sum
        async with steps.lock:
            await steps.sum_free(unit)  # a first write whose worker left mid-upload
            t0 = steps.clock()
            count, total = wsum.count, wsum.total_weight
            kept, self._kept = (self._kept, []) if steps.config.robust else ([], self._kept)
            if kept:
                count, total = len(kept), sum(w for w, _ in kept)
            guard = steps.guard(unit)
            refused: list[str] = []

            def outer_step(progress: PieceDone | None) -> None:
                divisor = total
                if kept:
                    self._robust_mean(round_, kept)
                    divisor = 1.0
                # The weighted mean is the sum over the total weight: the step divides as it goes.
                # A step whose result would not be finite changes nothing (core/finite.py).
                why = guard.step(wsum.sums, divisor=divisor, on_piece=progress)
                if why is not None:
                    refused.append(why)
                wsum.reset()

            # A refused round still ends: it is published with the parameters unchanged, so the
            # workers waiting for round + 1 go on (docs/design/durability.md, "Non-finite results").
            await steps.checkpoints.publish(
                unit, round_ + 1, outer_step, before=lambda: barrier.advance(steps.live())
            )
            outer_s = steps.clock() - t0
        run_log = steps.run_log
        run_log.last_round_contributions = count
        if refused:
            run_log.refuse(
                unit.index, round_, count, refused[0], what="round", where=steps.where(unit)
            )
        entry = run_log.update(unit.index, round_, outer_s, count, None, refused=bool(refused))
        run_log.hint_upload_slots(entry)
        log.info(
            "round %d%s closed: %d contributions (weight %.3g); round %d open",
            round_,
            steps.where(unit),
            count,
            total,
            round_ + 1,
        )

    def _robust_mean(self, round_: int, kept: list[tuple[float, list[torch.Tensor]]]) -> None:
        """Blocking: write the robust mean of the round's kept uploads into the unit's sum."""
        config = self.steps.config
        result = robust_mean(
            [t for _, t in kept],
            [w for w, _ in kept],
            self.unit.sum.sums,
            clip_factor=config.clip_norm_factor,
            trim_fraction=config.trim_fraction,
        )
        clipped = sum(s < 1 for s in result.scales)
        if clipped or result.trimmed:
            log.info(
                "round %d: %d of %d uploads clipped (norms %s), %d trimmed at each end",
                round_,
                clipped,
                len(kept),
                "/".join(f"{n:.3g}" for n in result.norms),
                result.trimmed,
            )

    # --- membership and state -------------------------------------------------------------------

    def on_join(self, live: set[str]) -> None:
        self.barrier.on_register(live)

    def on_leave(self, worker_id: str) -> None:
        self.barrier.on_leave(worker_id)

    def open_with(self, live: set[str]) -> bool | None:
        if self.barrier.opened:
            return None
        return self.barrier.open_with(live)

    def set_num_workers(self, num_workers: int, live: set[str]) -> None:
        self.barrier.set_num_workers(num_workers, live)

    def public(self) -> State:
        b = self.barrier
        return State(
            round=b.round,
            uploading=tuple(sorted(b.uploading)),
            opened=b.opened,
            num_workers=b.num_workers,
            min_workers=b.min_workers,
            expected=tuple(sorted(b.expected)),
            submitted=tuple(sorted(b.submitted)),
            closing=b.closing,
        )
