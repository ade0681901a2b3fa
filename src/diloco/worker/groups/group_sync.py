"""How the ranks of a worker group go through a join or a sync together (docs/design/
groups.md): ``Lockstep`` runs the same sequence of collectives on every rank around rank 0's work
with the server, and ``GroupSync`` is the group's ``SyncStrategy``, which every rank runs at the
same steps, rank 0 wrapping whichever strategy ``worker/choose.py`` picked. The collectives
themselves are ``WorkerGroup``'s (``worker/groups/group.py``).

``Lockstep`` exists from the worker's construction: the group's join in ``start()`` is a
lockstep too, and runs before rank 0 has the registration reply its strategy is chosen from.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Generic, Protocol, TypeVar

from diloco.wire.messages import Registered
from diloco.worker.groups.group import LeaderReport, WorkerGroup
from diloco.worker.session import Session
from diloco.worker.strategy import SyncStrategy


class Lockstep:
    """One join or sync of every rank of ``group`` together: the samples pooled and (partitioned)
    the parameters collected on rank 0, rank 0's work with the server, its report broadcast, and
    rank 0's parameters on every rank after."""

    def __init__(self, group: WorkerGroup, session: Session) -> None:
        self.group = group
        self._s = session
        #: The sync period every rank counts to. Only a report changes it, so DyLU's new
        #: sync_every (rank 0's heartbeat thread) is taken by every rank at the same sync.
        self.period = session.sync_every
        #: How the last join or sync ended, as every rank saw it.
        self.last_outcome: str | None = None

    def start(self, join: Callable[[], None]) -> None:
        """The group's join: rank 0 registers and fetches (``join``), every rank ends with the
        global parameters. Raises on every rank if rank 0's join failed."""
        self.together(join, outcome="joined")

    def together(self, on_leader: Callable[[], None], outcome: str | None = None) -> None:
        """Every rank calls it at the same step; rank 0 runs ``on_leader`` in the middle.
        ``outcome``: what rank 0 reports when ``on_leader`` returns (None: read from how its
        metrics moved). Raises on every rank if ``on_leader`` raised on rank 0."""
        g, s = self.group, self._s
        s.syncing = True
        try:
            s.samples, s.tokens = g.pool_counts(s.samples, s.tokens)
            g.collect()
            if g.leader:
                before = dict(s.metrics)
                g.stream_begin()
                try:
                    on_leader()
                except BaseException as exc:
                    g.stream_end(adopted=False)  # the other ranks discard what they received
                    g.send_report(LeaderReport(ok=False, error=f"{type(exc).__name__}: {exc}"))
                    raise
                result = outcome or _outcome(before, s.metrics)
                streamed = g.stream_end(adopted=result == "adopted" and s.local.adopted)
                report = LeaderReport(
                    ok=True,
                    outcome=result,
                    worker_id=s.worker_id,
                    base_round=s.base_round,
                    sync_every=s.sync_every,
                    metrics=dict(s.metrics),
                    streamed=streamed,
                )
                g.send_report(report)
            else:
                g.stream_receive()
                report = g.receive_report()
                if not report.ok:
                    raise RuntimeError(f"rank 0 of the worker group failed: {report.error}")
                if report.streamed:
                    g.stream_apply()
            if not report.streamed:
                g.share()
            self._apply(report)
        finally:
            s.syncing = False

    def _apply(self, report: LeaderReport) -> None:
        s = self._s
        self.last_outcome = report.outcome
        self.period = report.sync_every
        s.local_step = 0
        if not self.group.leader:
            s.worker_id = report.worker_id
            s.base_round = report.base_round
            s.sync_every = report.sync_every
            assert report.metrics is not None
            s.metrics.update(report.metrics)


class Leader(Protocol):
    """What every group strategy asks of rank 0's own strategy: the part of ``SyncStrategy``
    that only the rank that talks to the server can answer."""

    @property
    def last_submission(self) -> str | None: ...

    @property
    def round(self) -> int: ...

    def join(self, reply: Registered) -> None: ...

    def rejoin(self, reply: Registered) -> str: ...


L = TypeVar("L", bound=Leader)


class LeaderFollowing(Generic[L]):
    """The members of a group strategy that rank 0 answers from its own strategy (``inner``)
    and the other ranks from what rank 0's reports told them."""

    def __init__(self, lockstep: Lockstep, session: Session, inner: L | None) -> None:
        assert (inner is not None) == lockstep.group.leader
        self.lockstep = lockstep
        self._s = session
        self._inner = inner

    @property
    def inner(self) -> L | None:
        """Rank 0's strategy (None on the other ranks)."""
        return self._inner

    @property
    def last_submission(self) -> str | None:
        return self._inner.last_submission if self._inner is not None else None

    @property
    def round(self) -> int:
        return self._inner.round if self._inner is not None else self._s.base_round

    def join(self, reply: Registered) -> None:
        assert self._inner is not None
        self._inner.join(reply)

    def rejoin(self, reply: Registered) -> str:
        assert self._inner is not None
        return self._inner.rejoin(reply)


class GroupSync(LeaderFollowing[SyncStrategy]):
    """The ``SyncStrategy`` of a worker group: every rank runs it; rank 0 wraps the strategy
    that talks to the server (``inner``), the others (``inner`` None) follow its reports."""

    # --- SyncStrategy ---------------------------------------------------------------------------

    def after_step(self) -> None:
        # The heartbeat's re-join flag waits for the sync step: the other ranks enter the
        # collectives at the step they all count, not when rank 0's heartbeat fails.
        if self._s.local_step >= self.lockstep.period:
            self.sync_now()

    def sync_now(self) -> None:
        self.lockstep.together(self._sync_on_leader)

    def finish(self, *, submit: bool) -> None:
        g, s = self.lockstep.group, self._s
        submit = g.agree_on(submit) and s.local_step > 0
        s.samples, s.tokens = g.pool_counts(s.samples, s.tokens)
        if submit:
            g.collect()
        if self._inner is None:
            if g.shards is not None and submit:
                g.receive_report()  # serves rank 0's commands until its last upload is sent
            return
        if g.shards is None or not submit:
            self._inner.finish(submit=submit)
            return
        try:
            self._inner.finish(submit=submit)
        finally:
            g.send_report(LeaderReport(ok=True, outcome="left"))

    def _sync_on_leader(self) -> None:
        assert self._inner is not None
        self._inner.sync_now()


def _outcome(before: Mapping[str, float], after: Mapping[str, float]) -> str:
    if after["failed_syncs"] > before["failed_syncs"]:
        return "kept_local"
    if after["rebases"] > before["rebases"]:
        return "rebased"
    if after["rounds"] > before["rounds"]:
        return "adopted"
    return "kept_local"  # refused ("continue", "wait"), or a re-join that kept the progress
