"""The goodput benchmark's pure parts: the data-parallel baseline's rules (its module docstring)
against hand-computed schedules, the chaos schedule's placement, and the reached-steps ledger
read from /status documents."""

from __future__ import annotations

import pytest
from benchmarks.faults.dataparallel_model import Costs, simulate
from benchmarks.faults.goodput_schedule import Fault, schedule
from benchmarks.faults.step_ledger import StepLedger


def costs(**kw: float) -> Costs:
    base = {
        "step_s": 1.0,
        "restart_s": 5.0,
        "server_restart_s": 3.0,
        "heartbeat_timeout": 2.0,
        "checkpoint_every": 2,
    }
    return Costs(**{**base, **kw})  # type: ignore[arg-type]


def test_without_faults_every_step_reaches_the_model() -> None:
    out = simulate(2, 4, 2, (), costs())
    assert (out.wall_s, out.computed, out.reached, out.goodput) == (4.0, 8, 8, 1.0)


def test_a_straggler_sets_every_steps_time() -> None:
    # 2 workers, H 2: "slow" fires once 1*2*2 = 4 steps are in (after step 2), "fast" at 8
    # (after step 4): steps 1-2 take 1 s, 3-4 take 4 s, 5-6 take 1 s.
    faults = (Fault(1, "slow", 1, factor=4.0), Fault(2, "fast", 1))
    out = simulate(2, 6, 2, faults, costs())
    assert (out.wall_s, out.computed, out.reached) == (12.0, 12, 12)


def test_a_kill_rolls_every_worker_back_to_the_checkpoint() -> None:
    # Fires half a round past round 1: (1*2 + 1) * 2 = 6 steps in, after step 3 (3 s). Step 3
    # (2 inner steps) came after the checkpoint at step 2: lost. 5 s restart, steps 3-4 again.
    out = simulate(2, 4, 2, (Fault(1, "kill", 0, offset=1),), costs())
    assert (out.wall_s, out.computed, out.reached, out.rollbacks) == (10.0, 10, 8, 1)
    assert out.goodput == pytest.approx(0.8)


def test_a_kill_at_a_checkpoint_loses_nothing_but_the_restart() -> None:
    out = simulate(2, 4, 2, (Fault(1, "kill", 0),), costs())
    assert (out.wall_s, out.computed, out.reached) == (9.0, 8, 8)


def test_a_freeze_shorter_than_the_heartbeat_timeout_stalls_everyone() -> None:
    out = simulate(2, 4, 2, (Fault(1, "freeze", 0, seconds=1.5),), costs())
    assert (out.wall_s, out.computed, out.reached, out.stall_s) == (5.5, 8, 8, 1.5)


def test_a_longer_freeze_stalls_until_the_eviction_then_the_rest_go_on_without_it() -> None:
    # 3 workers: fires after step 2 (6 in, clock 2); stall 2 s (the timeout), worker 0 out until
    # 2 + 5 = 7. Steps 3-5 with 2 workers (clock 4 -> 7), step 6 with 3 again (clock 8).
    out = simulate(3, 6, 2, (Fault(1, "freeze", 0, seconds=5.0),), costs())
    assert (out.wall_s, out.computed, out.reached, out.stall_s) == (8.0, 15, 15, 2.0)


def test_a_server_restart_stalls_everyone_and_loses_nothing() -> None:
    out = simulate(2, 4, 2, (Fault(1, "server"),), costs())
    assert (out.wall_s, out.computed, out.reached) == (7.0, 8, 8)


def test_faults_after_a_rollback_wait_for_their_point_again() -> None:
    # The kill (after step 3, at 3 s) takes the model back to step 2; the server fault at
    # round 2 (8 in) then fires after step 4 of the second pass (10 s), not before.
    faults = (Fault(1, "kill", 0, offset=1), Fault(2, "server"))
    out = simulate(2, 6, 2, faults, costs())
    assert out.wall_s == 3 + 5 + 2 + 3 + 2
    assert (out.computed, out.reached) == (14, 12)


def test_the_schedule_places_each_fault_once_in_order_on_three_workers() -> None:
    faults = schedule(20, 4, 20, seed=0, freeze_s=8.0)
    assert [(f.at, f.kind) for f in faults] == [
        (3, "kill"),
        (5, "slow"),
        (9, "fast"),
        (11, "freeze"),
        (15, "server"),
    ]
    kill, slow, fast, freeze, _ = faults
    assert len({kill.worker, slow.worker, freeze.worker}) == 3 and fast.worker == slow.worker
    assert (kill.offset, freeze.offset, slow.factor, freeze.seconds) == (10, 10, 4.0, 8.0)
    assert schedule(20, 4, 20, seed=0, freeze_s=8.0) == faults  # seeded
    short = schedule(6, 3, 4, seed=1, freeze_s=1.0)
    assert [f.at for f in short] == [1, 2, 3, 4, 5]


def test_the_schedule_refuses_what_it_cannot_place() -> None:
    with pytest.raises(ValueError, match="--workers >= 3"):
        schedule(20, 2, 10, seed=0, freeze_s=1.0)
    with pytest.raises(ValueError, match="at least 6 rounds"):
        schedule(5, 4, 10, seed=0, freeze_s=1.0)
    with pytest.raises(ValueError, match="unknown fault kind"):
        Fault(1, "melt", 0)
    with pytest.raises(ValueError, match="needs a worker"):
        Fault(1, "kill")


def status(round_: int, history: dict[int, dict[str, int]]) -> dict[str, object]:
    """A /status document's round and loss history (round -> worker -> steps)."""
    return {
        "round": round_,
        "loss_history": [
            {
                "round": r,
                "workers": [{"worker_id": w, "loss": 1.0, "steps": s} for w, s in ws.items()],
            }
            for r, ws in history.items()
        ],
    }


def test_sync_counts_an_upload_once_its_round_closed() -> None:
    ledger = StepLedger(sync=True)
    ledger.observe(status(2, {0: {"a": 5, "b": 5}, 1: {"a": 10, "b": 10}, 2: {"a": 15}}))
    assert ledger.per_worker() == {"a": 10, "b": 10}  # round 2 is still open
    ledger.observe(status(3, {2: {"a": 15, "b": 15}}))
    assert ledger.reached() == 30


def test_a_restarted_server_forgets_what_it_counted_past_its_checkpoint() -> None:
    ledger = StepLedger(sync=True)
    ledger.observe(status(3, {1: {"a": 10, "b": 10}, 2: {"a": 15, "b": 15}, 3: {"a": 20}}))
    ledger.server_restarted(2)  # it saved round 2 only: round 2's uploads died with it
    assert ledger.reached() == 20
    ledger.observe(status(3, {2: {"a": 20, "b": 15}}))  # sent again, a with more steps
    assert ledger.per_worker() == {"a": 20, "b": 15}


def test_the_largest_count_wins_across_a_workers_lives() -> None:
    ledger = StepLedger(sync=False)  # async: counted is in the model
    ledger.observe(status(9, {4: {"a": 30}, 6: {"a": 25}, 8: {"a": 35}}))  # 6: after a restart
    assert ledger.reached() == 35
    ledger.server_restarted(8)
    assert ledger.reached() == 30
    assert ledger.since() == 2 and ledger.round == 8  # a few rounds back: late uploads


def test_the_quorum_row_runs_only_where_the_server_lists_its_flags() -> None:
    from benchmarks.goodput import NAMES, ROWS

    assert NAMES == ["barrier", "async-dn", "quorum", "data-parallel"]
    quorum = next(r for r in ROWS if r.name == "quorum")
    assert quorum.server_args == ("--quorum", "3", "--grace", "auto") and quorum.sync
    today = "  --quorum-timeout S  (all-reduce)\n  --async  ...\n"  # a prefix is not the flag
    assert quorum.lacking(today) == ["--quorum", "--grace"]
    assert quorum.lacking("  --quorum K  ...\n  --grace auto|SECONDS\n") == []
    assert all(not r.lacking(today) for r in ROWS if r.name != "quorum")
