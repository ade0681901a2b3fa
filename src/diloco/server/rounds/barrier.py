"""The synchronous barrier as a plain state machine: who is expected, who has submitted, when a
round may close. No I/O and no tensors, so every rule is tested directly.

Rules (docs/design/server-mode.md, "Sync barrier"):
- Round 0 opens when ``num_workers`` workers have registered. Every round's expected set is the
  live registered workers when it opens, and does not grow afterwards.
- A round closes when every expected worker has submitted or left, and never with fewer than
  ``min_workers`` contributions.
- A submission names the round it was computed against. Older or newer rounds are refused with a
  verdict the worker can act on; a submission id counts at most once, retries included.
- A worker outside the expected set is refused, except when the expected set is exhausted and the
  round is short of ``min_workers`` contributions: then a registered worker that trained from this
  round's parameters may complete it (otherwise the round could never close).
- With a quorum rule (``--quorum``, server/rounds/quorum.py) a round also closes once its quorum
  of contributions is in and the grace window has passed, uploads still arriving or not; an
  upload whose base round closed without it (at most ``max_lateness`` rounds ago) is counted in
  the open round instead of refused. Without one, every rule above holds unchanged.
"""

from __future__ import annotations

from collections import OrderedDict

from diloco.server.rounds.aggregator import Check, Verdict
from diloco.server.rounds.quorum import QuorumRule

__all__ = ["Admission", "Check", "SyncBarrier", "Verdict"]


class Admission:
    """What the sync barrier and the async gate share: the upload each worker has in flight,
    and receipts of counted submission ids (bounded) for idempotent retries."""

    HISTORY = 8192  # submission ids remembered for idempotent retries

    def __init__(self) -> None:
        self.uploading: dict[str, str] = {}  # worker id -> submission id being received
        self.history: OrderedDict[str, int] = OrderedDict()  # submission id -> where it counted

    def begin_upload(self, worker_id: str, submission_id: str) -> None:
        assert worker_id not in self.uploading, "check() must have accepted this upload"
        self.uploading[worker_id] = submission_id

    def abort_upload(self, worker_id: str, submission_id: str) -> None:
        if self.uploading.get(worker_id) == submission_id:
            del self.uploading[worker_id]

    def _count(self, worker_id: str, submission_id: str, counted_in: int) -> None:
        """The upload in flight is counted in ``counted_in``: end it and keep its receipt."""
        assert self.uploading.get(worker_id) == submission_id, "counted without begin_upload()"
        del self.uploading[worker_id]
        self.history[submission_id] = counted_in
        while len(self.history) > self.HISTORY:
            self.history.popitem(last=False)


class SyncBarrier(Admission):
    """State of the current synchronous round."""

    def __init__(
        self,
        num_workers: int,
        min_workers: int = 1,
        round: int = 0,
        quorum: QuorumRule | None = None,
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if not 1 <= min_workers <= num_workers:
            raise ValueError(
                f"min_workers must be in [1, num_workers={num_workers}], got {min_workers}"
            )
        super().__init__()
        self.num_workers = num_workers
        self.min_workers = min_workers
        self.round = round
        self.opened = False
        self.expected: set[str] = set()
        self.submitted: dict[str, str] = {}  # worker id -> submission id, this round
        self.closing = False
        self.quorum = quorum

    # --- membership -------------------------------------------------------------------------

    def on_register(self, live: set[str]) -> None:
        """Call after a registration with the set of live workers."""
        if not self.opened and len(live) >= self.num_workers:
            self._open(live)
        # Dynamic join: the expected count grows to fit (a newcomer is expected from the next round).
        self.num_workers = max(self.num_workers, len(live))

    def set_num_workers(self, num_workers: int, live: set[str]) -> None:
        """An operator changed the expected worker count. Before round 0 it is how many must
        register; lowering it may open round 0 with the workers already here."""
        if num_workers < self.min_workers:
            raise ValueError(f"num_workers must be >= min_workers ({self.min_workers})")
        self.num_workers = num_workers
        if not self.opened and len(live) >= num_workers:
            self._open(live)

    def on_leave(self, worker_id: str) -> None:
        """A worker left (deregistered, evicted, kicked). Its accepted submission stays counted."""
        self.uploading.pop(worker_id, None)
        if worker_id not in self.submitted:
            self.expected.discard(worker_id)

    def open_with(self, live: set[str]) -> bool:
        """Open the round now with the workers here, though fewer than ``num_workers`` (a
        resumed server whose other workers did not come back). Needs ``min_workers`` of them."""
        if self.opened or len(live) < self.min_workers:
            return False
        self._open(live)
        return True

    def _open(self, live: set[str]) -> None:
        self.opened = True
        self.expected = set(live)
        if self.quorum is not None:
            self.quorum.open(self.round, len(live), self.min_workers, len(self.submitted))

    # --- submissions ------------------------------------------------------------------------

    def short(self) -> bool:
        """Every expected worker is done but the round lacks ``min_workers`` contributions."""
        return self.opened and self._expected_done() and len(self.submitted) < self.min_workers

    def check(self, worker_id: str, base_round: int, submission_id: str) -> Check:
        """Decide what to do with a submission before any of its payload is read."""
        if submission_id in self.history:
            return Check(Verdict.DUPLICATE, self.round, self.history[submission_id])
        if self.submitted.get(worker_id) == submission_id:
            return Check(Verdict.DUPLICATE, self.round, self.round)
        if base_round > self.round:
            return Check(Verdict.FUTURE, self.round)
        late = self.round - base_round
        if late and not self.may_merge(base_round):
            return Check(Verdict.STALE, self.round)
        # With a quorum an upload begun while its round closes is merged into the next one.
        if self.closing and self.quorum is None:
            return Check(Verdict.CLOSING, self.round)
        if worker_id in self.submitted:
            return Check(Verdict.ALREADY_SUBMITTED, self.round)
        if worker_id in self.uploading:
            return Check(Verdict.IN_PROGRESS, self.round)
        if not late and self.opened and worker_id not in self.expected and not self.short():
            return Check(Verdict.NOT_EXPECTED, self.round)
        return Check(Verdict.ACCEPT, self.round, staleness=late)

    def may_merge(self, base_round: int) -> bool:
        """May an upload computed against ``base_round`` count in the open round? (Always for
        the open round itself; for a closed one, within ``max_lateness`` of a quorum rule.)"""
        late = self.round - base_round
        if late <= 0:
            return True
        return self.quorum is not None and late <= self.quorum.max_lateness

    def record(self, worker_id: str, submission_id: str, base_round: int | None = None) -> None:
        """Count a fully received, validated submission in the open round (computed against
        ``base_round``, by default that round). Caller re-checked it just before; never while
        the round closes."""
        assert not self.closing, "a landing upload waits for the close to end"
        self._count(worker_id, submission_id, self.round)
        self.submitted[worker_id] = submission_id
        if self.quorum is not None:
            base = self.round if base_round is None else base_round
            self.quorum.arrived(self.round, len(self.submitted), base)

    # --- closing ----------------------------------------------------------------------------

    def _expected_done(self) -> bool:
        return all(w in self.submitted for w in self.expected)

    def ready(self) -> bool:
        """May the current round close now?"""
        if not self.opened or self.closing or len(self.submitted) < self.min_workers:
            return False
        if self._expected_done() and not self.uploading:
            return True
        # The quorum and its grace are in: uploads still arriving are merged into the next round.
        return self.quorum is not None and self.quorum.due()

    def deadline(self) -> float | None:
        """When the open round may close without its missing workers (None: not yet known,
        or no quorum rule)."""
        if self.quorum is None or not self.opened or self.closing:
            return None
        return self.quorum.deadline()

    def begin_close(self) -> int:
        assert self.ready()
        self.closing = True
        return self.round

    def advance(self, live: set[str]) -> None:
        """The outer step of the current round is applied: open the next round."""
        assert self.closing
        self.round += 1
        self.closing = False
        self.submitted = {}
        self.expected = set(live)
        if self.quorum is not None:
            self.quorum.open(self.round, len(live), self.min_workers)

    def public(self) -> dict[str, object]:
        return {
            "round": self.round,
            "opened": self.opened,
            "num_workers": self.num_workers,
            "min_workers": self.min_workers,
            "expected": sorted(self.expected),
            "submitted": sorted(self.submitted),
            "uploading": sorted(self.uploading),
            "closing": self.closing,
        }
