"""A worker group's streaming schedule (``worker/groups/group_streaming.py``): which collectives
every rank enters at which step, against fakes of the group and of rank 0's strategy. Rank 0
runs first and its broadcasts are replayed to a follower, which must enter the same sequence."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest

from diloco.core.fragments import sync_offsets
from diloco.worker.groups.group import LeaderReport
from diloco.worker.groups.group_streaming import GroupStreaming


class _Group:
    """Records each collective; a follower gets rank 0's broadcasts from ``replay``."""

    def __init__(self, leader: bool, replay: list[Any] | None = None) -> None:
        self.leader = leader
        self.shards = None  # not sharded (tests/processes/test_sharded_streaming.py is)
        self.calls: list[tuple[Any, ...]] = []
        self.sent: list[Any] = []  # what rank 0 broadcast, in order
        self._replay = list(replay or [])

    def _bcast(self, kind: str, value: Any) -> Any:
        self.calls.append((kind,))
        if self.leader:
            self.sent.append(value)
            return value
        return self._replay.pop(0)

    def broadcast_json(self, value: Any) -> Any:
        return self._bcast("json", value)

    def send_report(self, report: LeaderReport) -> None:
        self._bcast("report", report)

    def receive_report(self) -> LeaderReport:
        report = self._bcast("report", None)
        assert isinstance(report, LeaderReport)
        return report

    def pool_counts(self, samples: float, tokens: float) -> tuple[float, float]:
        self.calls.append(("pool",))
        return (samples, tokens) if self.leader else (0.0, 0.0)

    def collect(self, only: Any = None) -> None:
        self.calls.append(("collect", None if only is None else list(only)))

    def share(self, only: Any = None) -> None:
        self.calls.append(("share", None if only is None else list(only)))

    def agree_on(self, flag: bool) -> bool:
        self.calls.append(("agree",))
        return flag


class _Leader:
    """Rank 0's strategy: fragment k touches parameter "p{k}"; every exchange merges."""

    def __init__(self, session: Any, fail_send: int | None = None) -> None:
        self._s = session
        self.events: list[tuple[str, int, int]] = []  # (what, fragment, total step)
        self._inflight: int | None = None
        self._fail_send = fail_send
        self.rejoin_at: set[int] = set()

    last_submission = None
    round = 0

    def wants_rejoin(self) -> bool:
        return self._s.total_steps in self.rejoin_at

    def due_params(self, k: int) -> list[str]:
        return [f"p{k}"]

    def send_fragment(self, k: int) -> None:
        if k == self._fail_send:
            raise OSError("scripted")
        self.events.append(("send", k, self._s.total_steps))
        self._inflight = k
        self._s.metrics["fragments_sent"] += 1

    def merge_inflight(self) -> tuple[str, bool]:
        assert self._inflight is not None
        self.events.append(("merge", self._inflight, self._s.total_steps))
        self._inflight = None
        self._s.metrics["rounds"] += 1
        return "merge", False

    def rejoin_now(self) -> None:
        self.events.append(("rejoin", -1, self._s.total_steps))

    def abandon(self) -> None:
        self.events.append(("abandon", -1, self._s.total_steps))

    def finish(self, *, submit: bool) -> None:
        self.events.append(("finish", int(submit), self._s.total_steps))


def _rank(
    group: _Group, *, sync_every: int = 4, fragments: int = 2, tau: int = 1, leader: Any = None
) -> tuple[GroupStreaming, Any]:
    s = SimpleNamespace(
        settings=SimpleNamespace(overlap_steps=tau, num_fragments=fragments),
        sync_every=sync_every,
        total_steps=0,
        local_step=0,
        samples=0.0,
        tokens=0.0,
        metrics={"sync_time_s": 0.0, "fragments_sent": 0, "rounds": 0},
        last_step_at=0.0,
        worker_id="w",
        base_round=0,
        need_rejoin=threading.Event(),
    )
    lockstep = SimpleNamespace(group=group, period=sync_every, last_outcome=None)

    def together(on_leader: Any, outcome: Any = None) -> None:
        group.calls.append(("together",))
        if group.leader:
            on_leader()
        lockstep.period = group._bcast("period", s.sync_every)

    lockstep.together = together
    inner = leader(s) if group.leader and leader else _Leader(s) if group.leader else None
    return GroupStreaming(lockstep, s, inner), s  # type: ignore[arg-type]


def _steps(strategy: GroupStreaming, s: Any, n: int) -> None:
    for _ in range(n):
        s.total_steps += 1
        strategy.after_step()


def _follow(lead: _Group, steps: int, **kw: Any) -> _Group:
    group = _Group(False, lead.sent)
    strategy, s = _rank(group, **kw)
    _steps(strategy, s, steps)
    return group


@pytest.mark.parametrize(("sync_every", "fragments", "tau"), [(4, 2, 1), (4, 4, 1), (6, 2, 0)])
def test_rank_0_sends_and_merges_as_a_single_worker_and_every_rank_follows(
    sync_every: int, fragments: int, tau: int
) -> None:
    kw = {"sync_every": sync_every, "fragments": fragments, "tau": tau}
    lead = _Group(True)
    strategy, s = _rank(lead, **kw)
    _steps(strategy, s, 2 * sync_every)
    inner = strategy.inner
    assert isinstance(inner, _Leader)
    expected = []
    for period in range(2):
        for k, at in enumerate(sync_offsets(sync_every, fragments)):
            step = period * sync_every + at
            expected += [("send", k, step), ("merge", k, step + tau)]
    expected = [e for e in expected if e[2] <= 2 * sync_every]
    assert inner.events == expected
    # Each due step: rank 0's intent, the samples, the fragment's gather, the verdict; each
    # merge: the gather again (steps went by since it was sent), whether all moved, the
    # fragment's share, the report.
    first = ["json", "pool", "collect", "json"]
    assert [c[0] for c in lead.calls[:4]] == first
    assert ("collect", ["p0"]) in lead.calls and ("share", ["p0"]) in lead.calls
    follower = _follow(lead, 2 * sync_every, **kw)
    assert follower.calls == lead.calls


def test_a_fragment_still_out_when_the_next_is_due_is_merged_first() -> None:
    lead = _Group(True)
    strategy, s = _rank(lead, sync_every=4, fragments=2, tau=3)  # due at 2 and 4
    _steps(strategy, s, 4)
    inner = strategy.inner
    assert isinstance(inner, _Leader)
    assert inner.events == [("send", 0, 2), ("merge", 0, 4), ("send", 1, 4)]
    assert _follow(lead, 4, sync_every=4, fragments=2, tau=3).calls == lead.calls


def test_a_rejoin_replaces_the_due_fragment_on_every_rank() -> None:
    class Rejoins(_Leader):
        def __init__(self, session: Any) -> None:
            super().__init__(session)
            self.rejoin_at = {4}

    lead = _Group(True)
    strategy, s = _rank(lead, leader=Rejoins)
    _steps(strategy, s, 6)
    inner = strategy.inner
    assert isinstance(inner, _Leader)
    assert inner.events == [("send", 0, 2), ("merge", 0, 3), ("rejoin", -1, 4), ("send", 0, 6)]
    follower = _follow(lead, 6)
    assert follower.calls == lead.calls
    assert ("together",) in follower.calls


def test_the_period_changes_only_through_a_verdict_at_a_period_boundary() -> None:
    lead = _Group(True)
    strategy, s = _rank(lead, sync_every=4, fragments=2, tau=1)
    _steps(strategy, s, 2)  # fragment 0 sent
    s.sync_every = 8  # DyLU, from rank 0's heartbeat thread, mid-period
    _steps(strategy, s, 1)  # the merge's report carries it
    assert strategy.lockstep.period == 8 and strategy.schedule.sync_every == 4
    _steps(strategy, s, 1)  # period boundary: taken now
    assert strategy.schedule.sync_every == 8
    inner = strategy.inner
    assert isinstance(inner, _Leader)
    _steps(strategy, s, 8)
    assert [e for e in inner.events if e[0] == "send"] == [
        ("send", 0, 2),
        ("send", 1, 4),
        ("send", 0, 8),
        ("send", 1, 12),
    ]


def test_a_failed_send_on_rank_0_raises_on_every_rank() -> None:
    lead = _Group(True)
    strategy, s = _rank(lead, leader=lambda session: _Leader(session, fail_send=0))
    with pytest.raises(OSError, match="scripted"):
        _steps(strategy, s, 2)
    group = _Group(False, lead.sent)
    follower, fs = _rank(group)
    with pytest.raises(RuntimeError, match="rank 0 of the worker group failed: OSError: scripted"):
        _steps(follower, fs, 2)
    assert group.calls == lead.calls


def test_finish_merges_the_fragment_in_flight_on_every_rank_before_the_hand_in() -> None:
    lead = _Group(True)
    strategy, s = _rank(lead, tau=2)
    _steps(strategy, s, 2)  # fragment 0 out until step 4
    strategy.finish(submit=True)
    inner = strategy.inner
    assert isinstance(inner, _Leader)
    assert [e[0] for e in inner.events] == ["send", "abandon", "merge", "finish"]
    assert lead.calls[-2:] == [("pool",), ("collect", None)]
    group = _Group(False, lead.sent)
    follower, fs = _rank(group, tau=2)
    _steps(follower, fs, 2)
    follower.finish(submit=True)
    assert group.calls == lead.calls


def test_force_sync_sends_and_merges_every_fragment_in_turn_on_every_rank() -> None:
    lead = _Group(True)
    strategy, s = _rank(lead, tau=2)
    _steps(strategy, s, 1)
    strategy.sync_now()
    inner = strategy.inner
    assert isinstance(inner, _Leader)
    assert inner.events == [("send", 0, 1), ("merge", 0, 1), ("send", 1, 1), ("merge", 1, 1)]
    assert strategy.schedule.phase == 1  # the schedule goes on where it was
    group = _Group(False, lead.sent)
    follower, fs = _rank(group, tau=2)
    _steps(follower, fs, 1)
    follower.sync_now()
    assert group.calls == lead.calls
