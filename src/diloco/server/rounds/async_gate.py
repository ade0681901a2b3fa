"""Admission of asynchronous submissions as a plain state machine: no barrier, but still one
count per submission id, no submission against parameters the server never published, and an
optional bound on staleness. No I/O and no tensors, so every rule is tested directly.

``version`` counts the outer updates applied to the part of the model this gate guards (the
whole model, or one fragment). A worker names the version its snapshot holds; the staleness of
its submission is how many updates other workers applied since.
"""

from __future__ import annotations

from diloco.server.rounds.aggregator import Check, Verdict
from diloco.server.rounds.barrier import Admission


class AsyncGate(Admission):
    def __init__(self, version: int = 0, max_staleness: int | None = None) -> None:
        if max_staleness is not None and max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        super().__init__()  # history: submission id -> the version it was applied to
        self.version = version
        self.max_staleness = max_staleness

    def check(self, worker_id: str, base_version: int, submission_id: str) -> Check:
        """Decide before any payload byte is read. Staleness is re-measured at application."""
        if submission_id in self.history:
            return Check(Verdict.DUPLICATE, self.version, counted_in=self.history[submission_id])
        if base_version > self.version:
            return Check(Verdict.FUTURE, self.version)
        if worker_id in self.uploading:
            return Check(Verdict.IN_PROGRESS, self.version)
        stale = self.version - base_version
        if self.max_staleness is not None and stale > self.max_staleness:
            return Check(Verdict.TOO_STALE, self.version, staleness=stale)
        return Check(Verdict.ACCEPT, self.version, staleness=stale)

    def on_leave(self, worker_id: str) -> None:
        self.uploading.pop(worker_id, None)

    def staleness_now(self, base_version: int) -> int:
        """Staleness at application time: updates applied while the body was on the wire count."""
        return self.version - base_version

    def too_stale(self, base_version: int) -> bool:
        return (
            self.max_staleness is not None and self.staleness_now(base_version) > self.max_staleness
        )

    def record(self, worker_id: str, submission_id: str) -> int:
        """The submission is being applied as the next update; returns the version it applies to
        (the update makes ``version + 1``)."""
        self._count(worker_id, submission_id, self.version)
        return self.version

    def record_gated(self, worker_id: str, submission_id: str) -> int:
        """The submission is acknowledged but not applied (its staleness policy gave it weight
        0): no update is made. Its receipt names the update that made the current version
        (``version - 1``), so its worker adopts the current version, and a retry of the same id
        is a duplicate with the same answer. A gated submission is stale, so ``version >= 1``."""
        assert self.version >= 1, "a submission against the current version is never gated"
        self._count(worker_id, submission_id, self.version - 1)
        return self.version - 1

    def advance(self) -> None:
        """The update is applied and published."""
        self.version += 1
