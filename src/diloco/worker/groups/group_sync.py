"""The ``SyncStrategy`` of a worker group (docs/design.md, "Worker groups"): every rank runs it at
the same steps; rank 0 wraps the plain (or all-reduce) strategy and talks to the server, the
other ranks follow the verdict it broadcasts. The collectives themselves are ``WorkerGroup``'s
(worker/groups/group.py)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from diloco.worker.groups.group import Verdict, WorkerGroup
from diloco.worker.session import Session
from diloco.worker.strategy import JoinAnswer, SyncStrategy


class GroupSync:
    """The ``SyncStrategy`` of a worker group: every rank runs it; rank 0 wraps the plain
    strategy (``inner``) and the others follow its verdicts."""

    def __init__(self, group: WorkerGroup, session: Session, inner: SyncStrategy | None) -> None:
        assert (inner is not None) == group.leader
        self.group = group
        self._s = session
        self._inner = inner
        # Only a verdict changes the period, so DyLU's new sync_every (rank 0's heartbeat
        # thread) is taken by every rank at the same sync.
        self._period = session.sync_every
        self.last_outcome: str | None = None

    @property
    def inner(self) -> SyncStrategy | None:
        """Rank 0's strategy (None on the other ranks)."""
        return self._inner

    def use_inner(self, inner: SyncStrategy) -> None:
        """Rank 0: sync with ``inner`` from now on (the server's mode, learnt at registration,
        asks for another strategy than the one built before it)."""
        assert self.group.leader
        self._inner = inner

    # --- SyncStrategy ---------------------------------------------------------------------------

    @property
    def last_submission(self) -> str | None:
        return self._inner.last_submission if self._inner is not None else None

    @property
    def round(self) -> int:
        return self._inner.round if self._inner is not None else self._s.base_round

    def configure(self, reply: Mapping[str, Any]) -> None:
        assert self._inner is not None
        self._inner.configure(reply)

    def joined(self, metadata: Mapping[str, str]) -> None:
        assert self._inner is not None
        self._inner.joined(metadata)

    def rejoined(self, answer: JoinAnswer) -> str:
        assert self._inner is not None
        return self._inner.rejoined(answer)

    def after_step(self) -> None:
        # The heartbeat's re-join flag waits for the sync step: the other ranks enter the
        # collectives at the step they all count, not when rank 0's heartbeat fails.
        if self._s.local_step >= self._period:
            self.sync_now()

    def sync_now(self) -> None:
        self._together(self._sync_on_leader)

    def finish(self, *, submit: bool) -> None:
        g, s = self.group, self._s
        submit = g.agree_on(submit) and s.local_step > 0
        s.samples = g.pool_samples(s.samples)
        if submit:
            g.collect()
        if self._inner is not None:
            self._inner.finish(submit=submit)

    # --- the protocol ---------------------------------------------------------------------------

    def start(self, join: Callable[[], None]) -> None:
        """The group's join: rank 0 registers and fetches (``join``), every rank ends with the
        global parameters. Raises on every rank if rank 0's join failed."""
        self._together(join, outcome="joined")

    def _together(self, on_leader: Callable[[], None], outcome: str | None = None) -> None:
        g, s = self.group, self._s
        s.syncing = True
        try:
            s.samples = g.pool_samples(s.samples)
            g.collect()
            if g.leader:
                before = dict(s.metrics)
                g.stream_begin()
                try:
                    on_leader()
                except BaseException as exc:
                    g.stream_end(adopted=False)  # the other ranks discard what they received
                    g.send_verdict(Verdict(ok=False, error=f"{type(exc).__name__}: {exc}"))
                    raise
                result = outcome or _outcome(before, s.metrics)
                streamed = g.stream_end(adopted=result == "adopted" and s.local.adopted)
                verdict = Verdict(
                    ok=True,
                    outcome=result,
                    worker_id=s.worker_id,
                    base_round=s.base_round,
                    sync_every=s.sync_every,
                    metrics=dict(s.metrics),
                    streamed=streamed,
                )
                g.send_verdict(verdict)
            else:
                g.stream_receive()
                verdict = g.receive_verdict()
                if not verdict.ok:
                    raise RuntimeError(f"rank 0 of the worker group failed: {verdict.error}")
                if verdict.streamed:
                    g.stream_apply()
            if not verdict.streamed:
                g.share()
            self._apply(verdict)
        finally:
            s.syncing = False

    def _sync_on_leader(self) -> None:
        assert self._inner is not None
        self._inner.sync_now()

    def _apply(self, verdict: Verdict) -> None:
        s = self._s
        self.last_outcome = verdict.outcome
        self._period = verdict.sync_every
        s.local_step = 0
        if not self.group.leader:
            s.worker_id = verdict.worker_id
            s.base_round = verdict.base_round
            s.sync_every = verdict.sync_every
            assert verdict.metrics is not None
            s.metrics.update(verdict.metrics)


def _outcome(before: Mapping[str, float], after: Mapping[str, float]) -> str:
    if after["failed_syncs"] > before["failed_syncs"]:
        return "kept_local"
    if after["rebases"] > before["rebases"]:
        return "rebased"
    if after["rounds"] > before["rounds"]:
        return "adopted"
    return "kept_local"  # refused ("continue", "wait"), or a re-join that kept the progress
