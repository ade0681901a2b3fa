"""Streaming fragments inside a worker group (docs/design/groups.md "Streaming fragments").

A single streaming worker (``server_mode/streaming.py``) sends one fragment when it is due and
merges its result ``overlap_steps`` (tau) steps later. In a group only rank 0 talks to the
server, so every rank counts the same schedule and enters the same collectives at each
fragment's due step and at its merge step, the verdict protocol of a whole-model sync applied
to one fragment:

- **due step**: rank 0 says whether it re-joins instead (the heartbeat's flag, read only here,
  so every rank learns it at the same step) and which parameters the fragment touches. A
  re-join is a whole-model ``Lockstep.together``. Otherwise the samples are pooled, a
  partitioned group gathers the fragment's parameters to rank 0, rank 0 copies its
  pseudo-gradient out and hands it to its sender thread, and a short verdict (fragment, ok) is
  broadcast;
- **merge step** (due + tau; at once when tau is 0, or before the next due fragment if it is
  still out): rank 0 waits for the result (a stall, counted on rank 0 and carried to every rank
  by the verdict) and merges; the fragment's parameters go from rank 0 to every rank
  (broadcast, or scatter when partitioned), then the verdict (outcome, round, period, metrics,
  or the error every rank raises).

The period changes only through a verdict and is taken at a period boundary, as a single
worker's ``_retime`` does. Rank 0's side is ``FragmentLeader`` (``StreamingSync`` satisfies it):
its fill and merge go through ``LocalModel.fill_piece`` and ``move_piece``, which a sharded
group's ``ShardedModel`` overrides to reach the shards (``sharded_pieces.py``): there the other
ranks serve rank 0's commands until the due step's verdict and the merge's report.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Protocol

from diloco.core.fragments import Schedule
from diloco.worker.groups.group import LeaderReport
from diloco.worker.groups.group_sync import Leader, LeaderFollowing, Lockstep
from diloco.worker.session import Session

log = logging.getLogger(__name__)

_OUTCOMES = {"merge": "adopted", "rebase": "rebased"}
"""A fragment exchange's outcome as a group reports it (anything else: "kept_local")."""


class FragmentLeader(Leader, Protocol):
    """What rank 0's streaming strategy offers the group (``StreamingSync``)."""

    def wants_rejoin(self) -> bool:
        """The due fragment must be a re-join instead (read only at a due step)."""
        ...

    def due_params(self, k: int) -> list[str]:
        """The parameters the fragment sent now touches (``k``: the schedule's)."""
        ...

    def send_fragment(self, k: int) -> None: ...

    def merge_inflight(self) -> tuple[str, bool]:
        """Wait for the fragment in flight and merge it: its outcome ("merge", "rebase",
        "keep", "failed", ...) and whether parameters outside it moved too (a state received,
        another fragment averaged): then the group shares them all."""
        ...

    def rejoin_now(self) -> None: ...

    def abandon(self) -> None: ...

    def finish(self, *, submit: bool) -> None: ...


@dataclass
class _Pending:
    """A fragment handed to rank 0's sender, as every rank knows it."""

    fragment: int
    names: list[str]  # the parameters it touches
    sent_at: int  # the total step count when it was handed to the sender
    merge_at: int  # the total step count after which it is merged


class GroupStreaming(LeaderFollowing[FragmentLeader]):
    """The ``SyncStrategy`` of a worker group with ``num_fragments > 1`` (server mode): every
    rank runs it; rank 0 wraps its ``StreamingSync`` (``inner``), the others follow."""

    def __init__(self, lockstep: Lockstep, session: Session, inner: FragmentLeader | None) -> None:
        super().__init__(lockstep, session, inner)
        self.tau = session.settings.overlap_steps
        self.schedule = Schedule(session.sync_every, session.settings.num_fragments)
        self._pending: _Pending | None = None

    # --- SyncStrategy ---------------------------------------------------------------------------

    def after_step(self) -> None:
        """The single worker's schedule, with a collective wherever rank 0 would act."""
        s = self._s
        t0 = time.monotonic()
        busy = False
        if self._pending is not None and s.total_steps >= self._pending.merge_at:
            self._merge()
            busy = True
        due = self.schedule.advance()
        s.local_step = self.schedule.phase
        if due is not None:
            busy = True
            self._due(due)
            if self.tau == 0 and self._pending is not None:
                self._merge()
        if self.schedule.phase == 0:
            # The period every rank agreed on at a verdict (DyLU's, from rank 0's heartbeats).
            period = max(self.lockstep.period, self.schedule.num_fragments)
            if period != self.schedule.sync_every:
                self.schedule.retime(period)
        if busy:
            s.metrics["sync_time_s"] += time.monotonic() - t0
            s.last_step_at = time.monotonic()

    def sync_now(self) -> None:
        """Every fragment in turn, each merged before the next is sent (a re-join instead, if
        rank 0 must make one)."""
        for k in range(self.schedule.num_fragments):
            if not self._due(k):
                return
            self._merge()

    def finish(self, *, submit: bool) -> None:
        """A collective: the exchange in flight ends (after its current poll) and is merged on
        every rank, then rank 0 hands in every fragment's steps since it was last sent."""
        g, s = self.lockstep.group, self._s
        submit = g.agree_on(submit)
        if self._inner is not None:
            self._inner.abandon()
        try:
            if self._pending is not None:
                self._merge()
        except BaseException:  # raised on every rank: rank 0 still stops its sender
            if self._inner is not None:
                self._inner.finish(submit=False)
            raise
        s.samples, s.tokens = g.pool_counts(s.samples, s.tokens)
        if submit:
            g.collect()
        if g.shards is not None and submit:  # rank 0's last uploads gather from the shards
            if self._inner is None:
                g.receive_report()
                return
            try:
                self._inner.finish(submit=submit)
            finally:
                g.send_report(LeaderReport(ok=True, outcome="left"))
            return
        if self._inner is not None:
            self._inner.finish(submit=submit)

    # --- the collectives ------------------------------------------------------------------------

    def _due(self, k: int) -> bool:
        """Fragment ``k`` is due on every rank: True if it was handed to rank 0's sender,
        False if rank 0 re-joined instead."""
        g, s = self.lockstep.group, self._s
        if self._pending is not None:  # at most one exchange in flight
            self._merge()
        intent = None
        if self._inner is not None:
            rejoin = self._inner.wants_rejoin()
            intent = {"rejoin": rejoin, "names": [] if rejoin else self._inner.due_params(k)}
        intent = g.broadcast_json(intent)
        if intent["rejoin"]:
            inner = self._inner
            self.lockstep.together(inner.rejoin_now if inner is not None else _nothing)
            s.local_step = self.schedule.phase  # the lockstep counts from 0; the schedule not
            # The lockstep reported the session's round; a streaming worker's is its fragments'.
            round_ = g.broadcast_json(inner.round if inner is not None else None)
            if not g.leader:
                s.base_round = round_
            return False
        names: list[str] = intent["names"]
        s.samples, s.tokens = g.pool_counts(s.samples, s.tokens)
        g.collect(names)
        error: BaseException | None = None
        verdict: Any = None
        if self._inner is not None:
            try:
                self._inner.send_fragment(k)
            except Exception as exc:  # every rank raises it, after the verdict
                error = exc
            verdict = {
                "ok": error is None,
                "fragment": k,
                "error": f"{type(error).__name__}: {error}",
                "metrics": dict(s.metrics),  # its send counted: every rank counts the same
            }
        if g.shards is not None and not g.leader:
            verdict = g.shards.serve()  # rank 0's fill gathers from the shards first
        else:
            verdict = g.broadcast_json(verdict)
        if error is not None:
            raise error
        if not verdict["ok"]:
            raise RuntimeError(f"rank 0 of the worker group failed: {verdict['error']}")
        if not g.leader:
            s.metrics.update(verdict["metrics"])
        self._pending = _Pending(k, names, s.total_steps, s.total_steps + self.tau)
        return True

    def _merge(self) -> None:
        """The pending fragment's result on every rank: rank 0 waits for it and merges, its
        parameters go to every rank, then the verdict."""
        g, s = self.lockstep.group, self._s
        job = self._pending
        assert job is not None
        self._pending = None
        if s.total_steps != job.sent_at:
            # Partitioned: the merge mixes the ranks' values of now, not those sent.
            g.collect(job.names)
        error: BaseException | None = None
        outcome, moved_all = "none", False
        if self._inner is not None:
            try:
                outcome, moved_all = self._inner.merge_inflight()
            except Exception as exc:
                error = exc
        # Rank 0's values whatever happened, so the ranks stay identical.
        if g.shards is not None and not g.leader:  # rank 0's merge moved the shards first
            moved_all = bool(g.shards.serve()["moved_all"])
        elif g.shards is not None:
            g.broadcast_json({"moved_all": moved_all})  # ends the other ranks' serve
        else:
            moved_all = bool(g.broadcast_json(moved_all))
        g.share(None if moved_all else job.names)
        if self._inner is not None:
            report = LeaderReport(
                ok=error is None,
                outcome=_OUTCOMES.get(outcome, "kept_local"),
                error="" if error is None else f"{type(error).__name__}: {error}",
                worker_id=s.worker_id,
                base_round=self._inner.round,
                sync_every=s.sync_every,
                metrics=dict(s.metrics),
            )
            g.send_report(report)
            if error is not None:
                raise error
            if outcome != "merge":
                log.info("worker group: fragment %d %s", job.fragment, outcome)
        else:
            report = g.receive_report()
            if not report.ok:
                raise RuntimeError(f"rank 0 of the worker group failed: {report.error}")
        self._apply(report)

    def _apply(self, report: LeaderReport) -> None:
        s = self._s
        self.lockstep.last_outcome = report.outcome
        self.lockstep.period = report.sync_every
        if not self.lockstep.group.leader:
            s.worker_id = report.worker_id
            s.base_round = report.base_round
            s.sync_every = report.sync_every
            assert report.metrics is not None
            s.metrics.update(report.metrics)


def _nothing() -> None:
    """The other ranks' part of rank 0's work (they only take part in the collectives)."""
