"""Synchronous DiLoCo on one unit: the barrier (server/rounds/barrier.py) says who must submit and
when the round may close; the running sum collects the weighted uploads; closing the round is
one outer step on their weighted mean (or their robust mean), published as the next round.

With quorum rounds (``--quorum``) the aggregator also arms a timer on the event loop for the
barrier's deadline (the quorum's arrival plus the grace window), and counts a late upload (one
whose round closed while it arrived, or before it began) in the open round, its weight scaled by
``core.grace.late_weight``. An upload that lands while its round's outer step runs waits for
that step to end, so it is counted once, in the next round, never in a sum already taken.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping

import torch

from diloco.core.accumulate import Entry
from diloco.core.grace import late_weight
from diloco.core.outer import PieceDone
from diloco.core.robust import robust_mean
from diloco.server.errors import conflict
from diloco.server.observe.records import LateMergeStatus, QuorumRounds, State
from diloco.server.rounds.aggregator import Check, Landed, Verdict
from diloco.server.rounds.barrier import SyncBarrier
from diloco.server.rounds.outer_steps import OuterSteps
from diloco.server.rounds.quorum import LateMerge, QuorumRule
from diloco.server.rounds.units import Unit
from diloco.wire.messages import UploadReceipt

log = logging.getLogger(__name__)


class SyncAggregator:
    """One unit's rounds (``Aggregator``)."""

    def __init__(self, unit: Unit, steps: OuterSteps, round_: int) -> None:
        self.unit = unit
        self.steps = steps
        config = steps.config
        quorum = config.quorum_value
        rule = (
            None
            if quorum is None
            else QuorumRule(
                quorum,
                config.grace_seconds,
                floor=config.grace_floor,
                ceiling=config.grace_ceiling,
                max_lateness=config.max_lateness,
                clock=steps.clock,
            )
        )
        self.barrier = SyncBarrier(
            steps.model.num_workers, config.min_workers, round=round_, quorum=rule
        )
        #: With robust aggregation: the open round's uploads (weight, fp32 tensors).
        self._kept: list[tuple[float, list[torch.Tensor]]] = []
        #: Set when the closing round's next round opens (uploads landing meanwhile wait).
        self._opened = asyncio.Event()
        self._timer: asyncio.TimerHandle | None = None

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
        # aggregation: the round keeps each upload whole, not a running sum. Not with a quorum:
        # a close must not wait for the body that owns the sum (it may be the late one).
        return (
            len(self.steps.model.units) == 1
            and not self.steps.config.robust
            and self.barrier.quorum is None
            and not self.unit.sum.count
        )

    def reads_late(self) -> bool:
        return False

    async def accept(self, landed: Landed) -> UploadReceipt:
        barrier = self.barrier
        if barrier.closing:  # quorum rounds: its round closed while it arrived
            await self._opened.wait()
            if barrier.closing:  # that outer step failed: nothing will open the next round
                raise self._refused(Verdict.CLOSING, landed, "round {now} is closing; rebase")
        if not barrier.may_merge(landed.base):
            raise self._refused(
                Verdict.STALE,
                landed,
                "round {base} closed more than max_lateness rounds ago "
                "(the server is at round {now}); rebase onto the current parameters",
            )
        if not self.is_current(landed.worker_id, landed.submission_id):
            raise self._refused(Verdict.STALE, landed, "superseded while round {now} closed")
        late = barrier.round - landed.base
        weight = landed.weight * late_weight(late) if late else landed.weight
        counted = barrier.round
        # From here on the submission counts: record it, then queue the addition on the tensor
        # lock before yielding, so a round close queued later sees it.
        barrier.record(landed.worker_id, landed.submission_id, landed.base)
        self._arm()
        if late:
            assert barrier.quorum is not None
            barrier.quorum.merged_late(
                LateMerge(counted, landed.base, landed.worker_id, late_weight(late))
            )
            log.info(
                "round %d%s: late upload of worker %s (base round %d) merged with weight x%.3g",
                counted,
                self.steps.where(self.unit),
                landed.worker_id,
                landed.base,
                late_weight(late),
            )
        if landed.written:
            self.unit.sum.commit_first(weight)
        else:
            assert landed.add is not None and landed.sum_add is not None
            add = (
                self._keep(landed.tensors, weight)
                if self.steps.config.robust
                else landed.sum_add(weight)
            )
            await landed.add(add)
        if not late:
            return UploadReceipt(status="accepted", round=counted)
        return UploadReceipt(status="accepted", round=counted, late=late, weight=weight)

    def _refused(self, verdict: Verdict, landed: Landed, detail: str) -> Exception:
        now = self.barrier.round
        return conflict(
            verdict.value,
            detail.format(base=landed.base, now=now),
            round=now,
            action="rebase",
            fragment=self.steps.model.fragment_of(self.unit),
        )

    def _arm(self) -> None:
        """Quorum rounds: wake the coordinator at the barrier's deadline, once per round (it
        re-checks ``ready`` then; a timer that fires early re-arms)."""
        deadline = self.barrier.deadline()
        if deadline is None or self._timer is not None:
            return

        def fire() -> None:
            self._timer = None
            self.steps.wake()  # closes the round if it is ready
            if self.barrier.deadline() == deadline and self.steps.clock() < deadline:
                self._arm()  # the loop's timer ran ahead of the server's clock

        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # set up outside the server's loop (tests): its next wake checks
            return
        self._timer = loop.call_later(max(0.0, deadline - self.steps.clock()), fire)

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
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._opened = asyncio.Event()  # uploads that land during the close wait for it
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
            def advance() -> None:
                barrier.advance(steps.live())
                self._opened.set()

            try:
                await steps.checkpoints.publish(unit, round_ + 1, outer_step, before=advance)
            finally:
                self._opened.set()  # a failed step too: the uploads waiting get their 409
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
        self._arm()  # round 0 may open with its quorum in already

    def on_leave(self, worker_id: str) -> None:
        self.barrier.on_leave(worker_id)

    def open_with(self, live: set[str]) -> bool | None:
        if self.barrier.opened:
            return None
        opened = self.barrier.open_with(live)
        self._arm()
        return opened

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
            quorum_rounds=self._quorum_status(),
        )

    def _quorum_status(self) -> QuorumRounds | None:
        rule, config = self.barrier.quorum, self.steps.config
        if rule is None:
            return None
        return QuorumRounds(
            quorum=str(config.quorum),
            grace=config.grace or "auto",
            max_lateness=rule.max_lateness,
            size=rule.k,
            grace_s=None if rule.window is None else round(rule.window, 4),
            late_merges=tuple(
                LateMergeStatus(m.round, m.base, m.worker_id, round(m.weight, 6)) for m in rule.late
            ),
            late_merges_total=rule.late_total,
        )
