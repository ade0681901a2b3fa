"""Asynchronous DiLoCo on one unit: no barrier; every submission is applied as it lands, as the
next update (version), weighted by the staleness policy (core/staleness.py). One the policy gives
weight 0 (the age gate) is acknowledged without an update. The admission rules are the gate's
(server/rounds/async_gate.py).
"""

from __future__ import annotations

from collections.abc import Mapping

from diloco.core.outer import PieceDone
from diloco.core.staleness import policy_named
from diloco.server.members.registry import WorkerRegistry
from diloco.server.observe.records import State
from diloco.server.rounds.aggregator import Check, Landed
from diloco.server.rounds.async_gate import AsyncGate
from diloco.server.rounds.outer_steps import OuterSteps
from diloco.server.rounds.units import Unit
from diloco.wire.messages import UploadReceipt


class AsyncAggregator:
    """One unit's versions (``Aggregator``)."""

    def __init__(
        self, unit: Unit, steps: OuterSteps, registry: WorkerRegistry, version: int
    ) -> None:
        self.unit = unit
        self.steps = steps
        self.registry = registry
        config = steps.config
        self.gate = AsyncGate(version, config.max_staleness)
        self.policy = policy_named(config.staleness_weighting, config.staleness_cutoff)

    @property
    def round(self) -> int:
        return self.gate.version

    @property
    def history(self) -> Mapping[str, int]:
        return self.gate.history

    @property
    def versioned(self) -> bool:
        return True

    def restore_receipt(self, submission_id: str, counted_in: int) -> None:
        self.gate.history[submission_id] = counted_in

    def check(self, worker_id: str, base: int, submission_id: str) -> Check:
        return self.gate.check(worker_id, base, submission_id)

    def begin_upload(self, worker_id: str, submission_id: str) -> None:
        self.gate.begin_upload(worker_id, submission_id)

    def abort_upload(self, worker_id: str, submission_id: str) -> None:
        self.gate.abort_upload(worker_id, submission_id)

    def is_current(self, worker_id: str, submission_id: str) -> bool:
        return self.gate.uploading.get(worker_id) == submission_id

    def first_write(self) -> bool:
        return False  # every body is applied whole, from its receive buffer

    def reads_late(self) -> bool:
        return True

    async def accept(self, landed: Landed) -> UploadReceipt:
        """Apply one submission as the next update of the unit. The reply names the version it
        made; the worker downloads it (or a newer one) next."""
        steps, unit, gate, base = self.steps, self.unit, self.gate, landed.base
        record = self.registry.get(landed.worker_id)
        assert record is not None  # checked current just before, with no await since
        async with steps.lock:
            t0 = steps.clock()
            if gate.too_stale(base):
                # Other updates were applied while this body was on the wire.
                steps.run_log.rejected += 1
                raise steps.too_stale(unit, base, gate.staleness_now(base))
            stale = gate.staleness_now(base)
            weight = self.policy.weight(stale)
            if weight == 0.0:
                return self._gated(landed, stale)
            applied_to = gate.record(landed.worker_id, landed.submission_id)
            guard = steps.guard(unit)
            refused: list[str] = []
            tensors = landed.tensors

            def outer_step(progress: PieceDone | None) -> None:
                unit.sum.add(tensors, weight)
                why = guard.step(unit.sum.sums, on_piece=progress)
                if why is not None:
                    refused.append(why)
                unit.sum.reset()

            # A refused update still makes its version (the parameters unchanged), as a refused
            # sync round does: the gate has recorded the submission, and its worker waits for it.
            await steps.checkpoints.publish(unit, applied_to + 1, outer_step, before=gate.advance)
            outer_s = steps.clock() - t0
        record.staleness = stale
        run_log = steps.run_log
        run_log.staleness(stale)
        run_log.last_round_contributions = 1
        if refused:
            run_log.refuse(
                unit.index, applied_to, 1, refused[0], what="update", where=steps.where(unit)
            )
        run_log.update(
            unit.index,
            applied_to,
            outer_s,
            1,
            landed.nbytes,
            staleness=stale,
            weight=weight,
            refused=bool(refused),
        )
        return UploadReceipt(
            status="accepted",
            round=applied_to,
            version=applied_to + 1,
            staleness=stale,
            weight=weight,
            refused=refused[0] if refused else None,
        )

    def _gated(self, landed: Landed, stale: int) -> UploadReceipt:
        """Past the age gate: counted as received (its id answered as a duplicate from now on),
        no parameter touched, no version made. The receipt's weight 0 tells the worker its
        steps did not reach the model; it adopts the current version (``round + 1``)."""
        counted_in = self.gate.record_gated(landed.worker_id, landed.submission_id)
        run_log = self.steps.run_log
        run_log.staleness(stale)
        run_log.gated += 1
        return UploadReceipt(
            status="accepted",
            round=counted_in,
            version=counted_in + 1,
            staleness=stale,
            weight=0.0,
        )

    # Nothing waits to close: every update is applied in ``accept``.

    def ready(self) -> bool:
        return False

    def begin_close(self) -> int:
        raise AssertionError("async updates never close")

    async def close(self, round_: int) -> None:
        raise AssertionError("async updates never close")

    def on_join(self, live: set[str]) -> None:
        pass  # no round waits for anyone

    def on_leave(self, worker_id: str) -> None:
        self.gate.on_leave(worker_id)

    def open_with(self, live: set[str]) -> bool | None:
        return None

    def set_num_workers(self, num_workers: int, live: set[str]) -> None:
        pass

    def public(self) -> State:
        return State(round=self.gate.version, uploading=tuple(sorted(self.gate.uploading)))
