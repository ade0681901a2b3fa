"""Trials on the simulated clock (benchmarks/harness/sim_clock.py, issue 32) through the real
in-process server and worker threads: the same seed gives the same upload order and bit-identical
final parameters, async with Delayed Nesterov, DyLU and a grace period as well as sync; sync's
rounds take the slowest worker's simulated time."""

from __future__ import annotations

from typing import Any

import pytest
from benchmarks.harness.trials import Trial, run_trial

COSTS = [0.58, 1.51, 3.33]  # three of the paper's four speeds: a small run


def small(mode: str, seed: int = 0, **clock: float) -> Trial:
    async_ = mode == "async"
    return Trial(
        f"{mode} on the clock",
        seed,
        workers=len(COSTS),
        sync_every=4,
        server={"mode": "async", "delayed_nesterov": True, "dylu": True} if async_ else {},
        worker={"dylu": True} if async_ else {},
        delays=COSTS,
        clock={"jitter": 0.1, **clock},
        total_steps=36,
        shared_budget=async_,
        batch_size=4,
        seq_len=32,
        curve=True,
        curve_windows=2,
        eval_windows=4,
    )


def fingerprint(row: dict[str, Any]) -> tuple:
    return (
        row["params_sha256"],
        row["uploads"],
        [w["steps"] for w in row["workers"]],
        [(p["wall_s"], p["updates"], p["eval_loss"]) for p in row["curve"]],
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_same_seed_same_uploads_and_bit_identical_parameters(mode: str) -> None:
    first = run_trial(small(mode, grace=0.5))
    assert fingerprint(run_trial(small(mode, grace=0.5))) == fingerprint(first)
    times = [t for t, _ in first["uploads"]]
    assert times == sorted(times)  # the server saw them in simulated order
    assert first["steps"] == 36
    if mode == "async":
        # DyLU from the clock's speeds: H = floor(v / v_max * 4), at least 1.
        assert [w["sync_every"] for w in first["workers"]] == [4, 1, 1]
        # The fastest worker takes the largest share of the shared budget.
        steps = [w["steps"] for w in first["workers"]]
        assert steps[0] > steps[1] > steps[2]
        # One curve point per update, in simulated time, at the last point every update seen.
        assert first["curve"][-1]["updates"] == first["updates"] == len(first["uploads"])


@pytest.mark.timeout(60)
def test_another_seed_another_schedule() -> None:
    """The jitter is drawn from the seed: another seed, other upload times."""
    a, b = run_trial(small("async", 0)), run_trial(small("async", 1))
    assert a["uploads"] != b["uploads"]


@pytest.mark.timeout(60)
def test_sync_rounds_take_the_slowest_workers_time() -> None:
    """Without jitter, 12 steps each at H = 4: three rounds of 4 x 3.33 s (the slowest
    worker), so the run's simulated time is 12 x 3.33 s, and the curve's points are the round
    closes."""
    row = run_trial(small("sync", jitter=0.0))
    assert row["wall_s"] == pytest.approx(12 * 3.33)
    closes = [p["wall_s"] for p in row["curve"]]
    assert closes == pytest.approx([0.0, 4 * 3.33, 8 * 3.33, 12 * 3.33])
