"""The async experiment's outer lr (issue 32): chosen by a sweep on the validation split like the
inner lrs, given to the async Delayed Nesterov rows, and counted by the plan. No training: the
sweep's rows are stubbed, the plan is counted by hand."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from benchmarks.quality import run, tuning
from benchmarks.quality.experiments import FAST, Config, async_lr, asynchronous
from benchmarks.quality.protocol import FAST as FAST_PROFILE
from benchmarks.quality.reach import TIMED
from benchmarks.quality.tuning import KINDS, run_outer_sweep, with_lr, with_outer_lr


def test_the_outer_sweep_picks_the_lowest_validation_loss(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Async + DN + DyLU at every outer lr of the scale's list, seed 0, on the validation split,
    at the reference M's swept inner lr, on the simulated clock; the lowest loss's outer lr wins
    (here 0.5, inside the list, so not flagged as its end)."""
    loss = {0.3: 2.3, 0.5: 2.1, 1.0: 2.4}
    seen: list[tuple[float, float | None, int, str]] = []

    def fake_run(config: Config, profile: Any, seed: int, scale: Any, cache: Path) -> dict:
        assert config.clock and config.server["mode"] == "async"
        seen.append((config.server["outer_lr"], config.lr, seed, config.heldout))
        return {"eval_loss": loss[config.server["outer_lr"]], "run_s": 2.0}

    monkeypatch.setattr(tuning, "run_config", fake_run)
    lrs = {k: float(i + 1) for i, k in enumerate(KINDS)}
    outer = run_outer_sweep(FAST_PROFILE, replace(FAST, async_lrs=(0.3, 0.5, 1.0)), tmp_path, lrs)
    assert outer["lr"] == 0.5 and not outer["edge"] and outer["run_s"] == 6.0
    assert seen == [(x, lrs["diloco"], 0, "valid") for x in (0.3, 0.5, 1.0)]
    assert outer["losses"] == [[0.3, 2.3], [0.5, 2.1], [1.0, 2.4]]


def test_a_best_outer_lr_at_the_lists_end_tries_the_next_points_beyond(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """0.3 is the best of (0.3, 0.5, 1.0): the list's first ratio (0.6) gives 0.18, better
    still, then 0.108, worse: 0.18 is chosen, inside what was tried, so not flagged."""
    loss = {0.3: 2.2, 0.5: 2.3, 1.0: 2.4, 0.18: 2.1, 0.108: 2.15}
    seen: list[float] = []

    def fake_run(config: Config, profile: Any, seed: int, scale: Any, cache: Path) -> dict:
        x = round(config.server["outer_lr"], 6)
        seen.append(x)
        assert config.server["delayed_nesterov"] and config.heldout == "valid"
        return {"eval_loss": loss[x], "run_s": 1.0}

    monkeypatch.setattr(tuning, "run_config", fake_run)
    lrs = {k: 1.0 for k in KINDS}
    outer = run_outer_sweep(FAST_PROFILE, replace(FAST, async_lrs=(0.3, 0.5, 1.0)), tmp_path, lrs)
    assert seen == [0.3, 0.5, 1.0, 0.18, 0.108]
    assert outer["lr"] == pytest.approx(0.18) and not outer["edge"] and outer["run_s"] == 5.0
    assert [x for x, _ in outer["losses"]] == pytest.approx([0.108, 0.18, 0.3, 0.5, 1.0])


def test_only_the_async_dn_rows_without_their_own_outer_lr_take_the_choice() -> None:
    """Sync and naive async keep outer lr 0.7 (the ServerConfig default and naive's own); the
    DN rows, claim g's timed row among them, take the sweep's; the sweep's rows keep theirs; and
    every row, async ones included, trains at the reference M's inner lr."""
    lrs = {k: float(i + 1) for i, k in enumerate(KINDS)}
    rows = {c.name: with_lr(with_outer_lr(c, 0.25), lrs) for c in asynchronous(FAST)}
    assert "outer_lr" not in rows["sync"].server
    assert rows["async (naive)"].server["outer_lr"] == 0.7
    for name in ("async + DN", "async + DN + DyLU", TIMED):
        assert rows[name].server["outer_lr"] == 0.25
    assert {c.lr for c in rows.values()} == {lrs["diloco"]}
    sweep_rows = [with_outer_lr(c, 0.25) for c in async_lr(FAST)]
    assert [c.server["outer_lr"] for c in sweep_rows] == list(FAST.async_lrs)


def test_the_plan_counts_the_async_rows() -> None:
    """FAST with a 1 s unit at 1 s per inner step, evaluation left out: each outer-sweep row is
    the shared budget, 12 steps x 4 workers = 48, on 2 cores (24 s), two of them; the async
    experiment's sync, naive, DN and DN + DyLU rows 48 steps each, and claim g's timed row the
    steps each worker fits in sync's time, 12 x 3.33 s: 68 + 53 + 26 + 12 = 159, all on 2 cores."""
    scale = replace(FAST, windows=0, async_unit=1.0)
    lines = {name: (steps, wall) for name, steps, wall in run.plan(scale, 1.0, 4)}
    assert lines["async outer sweep"] == (96, 48.0)
    assert lines["async"] == (4 * 48 + 159, (4 * 48 + 159) / 2)


def test_claim_fs_extra_try_is_sync_and_dn_dylu_on_the_iid_split() -> None:
    """The same two rows as the async experiment's sync and async + DN + DyLU (clock, budget,
    server), only the split changed; not part of the default command."""
    from benchmarks.quality.experiments import EXPERIMENTS, async_iid

    base = {c.name: c for c in asynchronous(FAST)}
    rows = async_iid(FAST)
    assert [c.name for c in rows] == ["sync, iid split", "async + DN + DyLU, iid split"]
    for row, name in zip(rows, ("sync", "async + DN + DyLU"), strict=True):
        assert row.split == "iid" and replace(row, name=name, split="non-iid") == base[name]
    assert not EXPERIMENTS["async_iid"].default
