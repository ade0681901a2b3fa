"""chaos_allreduce's fault schedule (benchmarks/faults/chaos_allreduce_schedule.py): planned
from the seed alone, on a clock that starts when training begins, every planned fault fired
however long joining and dealing with the faults take. Times are plain numbers: no clock runs."""

from __future__ import annotations

import pytest
from benchmarks.faults.chaos_allreduce_schedule import Fault, FaultClock, plan, victims


def test_the_plan_fits_the_fault_window_and_depends_on_the_seed_alone() -> None:
    faults = plan(0, 8.0, 3.0, 4.0, 17.0, 0.3)
    assert faults == plan(0, 8.0, 3.0, 4.0, 17.0, 0.3)
    assert faults[0].wait == 8.0
    assert all(3.0 <= f.wait <= 4.0 for f in faults[1:])
    starts = [sum(f.wait for f in faults[: i + 1]) for i in range(len(faults))]
    # As many as start before the end of the window when dealing with them takes no time:
    # 8, then 3-4 s apart, before 17 s: 3 faults (8, 11-12, 14-16; a fourth lands at 17+).
    assert len(faults) == 3 and starts[-1] < 17.0
    assert plan(0, 8.0, 3.0, 4.0, 7.0, 0.3) == ()
    assert {f.server for f in plan(1, 1.0, 1.0, 1.0, 50.0, 1.0)} == {True}
    assert {f.server for f in plan(1, 1.0, 1.0, 1.0, 50.0, 0.0)} == {False}
    with pytest.raises(ValueError, match="fault gaps"):
        plan(0, 8.0, 4.0, 3.0, 17.0, 0.3)


def test_nothing_is_due_before_training_begins_however_late_that_is() -> None:
    clock = FaultClock((Fault(8.0, False), Fault(3.0, True)), duration=25.0, settle=8.0)
    # The old schedule ran from the script's start: with joining taking 46 s, past its end.
    assert clock.due(1000.0) is None and clock.end() is None
    clock.begin(1046.0)
    clock.begin(1050.0)  # a later call changes nothing
    assert clock.due(1053.9) is None
    assert clock.due(1054.0) == Fault(8.0, False)
    assert clock.end() is None  # a fault remains
    clock.dealt_with(1061.0)  # 7 s to deal with it (an aimed kill, a replacement's start)
    assert clock.due(1063.9) is None  # the next wait runs from the end of the last fault
    assert clock.due(1064.0) == Fault(3.0, True)
    assert clock.due(1064.0) is None
    clock.dealt_with(1066.0)
    # 25 s of training (1071), and settle = 8 s after the last fault at the earliest (1074).
    assert clock.end() == 1074.0


def test_without_faults_the_run_lasts_the_duration_from_the_start_of_training() -> None:
    clock = FaultClock((), duration=25.0, settle=8.0)
    assert clock.end() is None and clock.due(10.0) is None
    clock.begin(46.0)
    assert clock.end() == 71.0 and clock.due(100.0) is None


def test_faults_dealt_with_in_time_end_the_run_at_its_duration() -> None:
    clock = FaultClock((Fault(8.0, False),), duration=25.0, settle=8.0)
    clock.begin(0.0)
    assert clock.due(8.0) == Fault(8.0, False)
    clock.dealt_with(9.0)
    assert clock.end() == 25.0


def test_a_kill_never_takes_the_last_worker_holding_the_model() -> None:
    """Holders are the workers that completed a sync. Two or more: any live worker may go; one:
    only those still joining; none (nothing trained yet): any."""
    holds = {"a": True, "b": True, "c": False}.__getitem__
    assert victims(["a", "b", "c"], holds) == ["a", "b", "c"]
    assert victims(["a", "c"], holds) == ["c"]
    assert victims(["a"], holds) == []  # the caller waits for a replacement to catch up
    assert victims(["c"], holds) == ["c"]
    assert victims([], holds) == []
