"""The quality suite's inner lr sweep and cost plan (issue 32), without training: the sweep's rows
are stubbed, the plan is counted by hand."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from benchmarks.harness.curves import thin
from benchmarks.quality import run, tuning
from benchmarks.quality.experiments import DEFAULT, FAST, Config
from benchmarks.quality.protocol import FAST as FAST_PROFILE
from benchmarks.quality.suite import APART, EXPERIMENTS
from benchmarks.quality.tuning import KINDS, chosen_lrs, lr_kind, run_sweep, with_lr


def test_every_row_of_the_suite_maps_to_the_kind_the_page_names() -> None:
    """Baselines by budget, DiLoCo by M: one-worker AdamW at equal steps and at equal tokens,
    data-parallel, DiLoCo M=1, and every other DiLoCo row (any M >= 2, any variant) the
    reference M's kind; claim p's Muon rows their own (M=1, and every M >= 2), its AdamW rows
    DiLoCo's but at M=1 (four times the profile's batch there: a kind of its own)."""
    suite = [e for n, e in EXPERIMENTS.items() if n not in APART]
    kinds = {c.name: lr_kind(c) for e in suite for c in e.configs(DEFAULT)}
    assert kinds["AdamW, 1 worker (equal steps)"] == "adamw"
    assert kinds["AdamW, 1 worker, 4x steps (equal tokens to M=4)"] == "adamw_tokens"
    assert kinds["data-parallel, 4x batch"] == "dp"
    assert kinds["DiLoCo M=1"] == "diloco_m1"
    assert kinds["DiLoCo M=8"] == kinds["async + DN + DyLU"] == kinds["H=40"] == "diloco"
    assert kinds["Muon inner, M=1"] == "muon_m1"
    assert kinds["Muon inner, M=4"] == kinds["Muon inner, M=8"] == "muon"
    assert kinds["AdamW inner, M=1"] == "adamw_m1_batch" and kinds["AdamW inner, M=8"] == "diloco"
    assert set(kinds.values()) == set(KINDS)
    lrs = {k: float(i) for i, k in enumerate(KINDS)}
    assert with_lr(Config("x", kind="dp"), lrs).lr == lrs["dp"]


def test_the_sweep_picks_the_lowest_validation_loss_of_each_kind(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Every kind at every lr of the grid, seed 0, on the validation split; the chosen lr is the
    lowest loss's. A best at an end of the grid tries the next point beyond it (the grid's
    ratio), up to EXTEND of them: data-parallel's 8e-3 is confirmed by 1.6e-2, equal tokens'
    true best 5e-4 is found one step below the grid and confirmed by the next, and DiLoCo M=1's
    at 6.25e-5 is still beyond EXTEND points, so it stays flagged at the end of what was
    tried."""
    best = {
        "adamw": 4e-3,
        "adamw_tokens": 5e-4,
        "dp": 8e-3,
        "diloco_m1": 6.25e-5,
        "diloco": 2e-3,
        "adamw_m1_batch": 2e-3,
        "muon_m1": 4e-3,
        "muon": 2e-3,
    }
    seen: list[tuple[str, float, int, str]] = []

    def fake_run(config: Config, profile: Any, seed: int, scale: Any, cache: Path) -> dict:
        kind = lr_kind(config)
        assert config.lr is not None
        seen.append((kind, config.lr, seed, config.heldout))
        return {"eval_loss": 2 + math.log(config.lr / best[kind]) ** 2, "run_s": 1.5}

    monkeypatch.setattr(tuning, "run_config", fake_run)
    scale = replace(FAST, lrs=(1e-3, 2e-3, 4e-3, 8e-3))
    sweep = run_sweep(FAST_PROFILE, scale, tmp_path)
    chosen = chosen_lrs(sweep)
    assert chosen == {**best, "diloco_m1": 2.5e-4}
    assert tuning.EXTEND == 2
    assert {k: v["edge"] for k, v in sweep["kinds"].items()} == {
        "adamw": False,
        "adamw_tokens": False,
        "dp": False,
        "diloco_m1": True,
        "diloco": False,
        "adamw_m1_batch": False,
        "muon_m1": False,
        "muon": False,
    }
    extra = {"adamw_tokens": [5e-4, 2.5e-4], "dp": [1.6e-2], "diloco_m1": [5e-4, 2.5e-4]}
    grid = [(k, lr, 0, "valid") for k in KINDS for lr in scale.lrs]
    want = grid + [(k, lr, 0, "valid") for k, lrs in extra.items() for lr in lrs]
    assert sorted(seen) == sorted(want)
    assert [lr for lr, _ in sweep["kinds"]["dp"]["losses"]] == [*scale.lrs, 1.6e-2]
    assert sweep["grid"] == list(scale.lrs) and sweep["run_s"] == 1.5 * len(seen)


def test_the_plan_counts_each_distinct_row_once() -> None:
    """FAST at 1 s per step, evaluation left out (no windows): the sweep is, per lr, AdamW 4 steps
    + equal tokens 8 + data-parallel 4 x 2 batches + DiLoCo M=1 4 (one thread each) + DiLoCo M=2
    2 x 4 on two cores: 32 steps, 28 s; AdamW and Muon M=1 4 steps each of claim p's global
    batch (here the profile's: 4 s each) and Muon M=2 2 x 4 steps of half the batch on two cores
    (2 s): 48 steps, 38 s; single_worker's rows are scaling's, so it costs nothing; experiments
    not run by default are left out."""
    lines = {
        name: (steps, wall) for name, steps, wall in run.plan(replace(FAST, windows=0), 1.0, 4)
    }
    assert lines["pretrain"] == (FAST.pretrain_steps, FAST.pretrain_steps * 1.0)
    assert lines["lr sweep"] == (2 * 48, 2 * 38.0)
    assert lines["single_worker"] == (0, 0.0)
    assert "async_slow" not in lines and "sparse_lr" not in lines
    # scaling: AdamW 12, DiLoCo M=1 12 and M=2 2 x 12 (12 s), AdamW 2x steps 24: 72 steps, 60 s.
    assert lines["scaling"] == (72, 60.0)


def test_the_plan_counts_each_evaluation() -> None:
    """With 12 windows of batch 4 an evaluation costs 12 / (3 x 4) = 1 step: data_parallel's new
    row (data-parallel, 12 steps of 2 batches on one thread, a curve point every H = 4 steps)
    costs 24 s of steps and 3 + 1 evaluations."""
    scale = replace(FAST, windows=12)
    lines = {name: (steps, wall) for name, steps, wall in run.plan(scale, 1.0, 4)}
    assert lines["data_parallel"] == (24, 24.0 + 4.0)
    thinned = {n: w for n, _, w in run.plan(replace(scale, curve_points=2), 1.0, 4)}
    assert thinned["data_parallel"] == 24.0 + 3.0


def test_plan_prints_the_projection(capsys: pytest.CaptureFixture[str]) -> None:
    assert run.main(["--plan", "45"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("pretrain") and "total" in out.splitlines()[-1]


def test_curves_are_thinned_evenly_keeping_both_ends() -> None:
    """At most N curve points are evaluated: evenly spread, the first and the last (the final
    model, the table's figure) always among them."""
    points = list(range(161))
    assert thin(points, 20) == [round(i * 160 / 19) for i in range(20)]
    assert thin(points, 20)[0] == 0 and thin(points, 20)[-1] == 160
    assert thin(points, 0) == points and thin(points[:5], 20) == points[:5]
    assert thin(points, 1) == [160]


def test_the_page_shows_points_tried_beyond_the_grid_as_columns_of_their_own() -> None:
    """A kind that tried 5e-4 below the grid (1e-3, 2e-3) gets that column; the others a dash."""
    from benchmarks.quality.render import sweep_table

    sweep = {
        "steps": 8,
        "seed": 0,
        "grid": [1e-3, 2e-3],
        "kinds": {
            "a": {"what": "A", "losses": [[1e-3, 2.0], [2e-3, 2.5]], "lr": 1e-3, "edge": False},
            "b": {
                "what": "B",
                "losses": [[5e-4, 1.9], [1e-3, 2.0], [2e-3, 2.1]],
                "lr": 5e-4,
                "edge": True,
            },
        },
    }
    lines = sweep_table(sweep)
    assert "| kind | lr 0.0005 | lr 0.001 | lr 0.002 | chosen |" in lines
    assert "| A | — | **2.0000** | 2.5000 | 0.001 |" in lines
    assert (
        "| B | **1.9000** | 2.0000 | 2.1000 | 0.0005 (the end of what was tried: too narrow) |"
        in lines
    )
    assert "tried the next points beyond it until its best was inside (0.0005;" in lines[0]


def test_the_suite_time_counts_shared_rows_once_and_leaves_out_the_extra_tries() -> None:
    """A row two experiments share (same settings and seed) counts once; the rows of an
    experiment outside the default command (claim c's extra try) count not at all."""
    from benchmarks.quality.experiments import EXPERIMENTS as BASE
    from benchmarks.quality.render import EXTRA, suite_time

    assert not BASE["sync_every_lr"].default and "sync_every_lr" in EXTRA["sync_every"]
    shared = {"config": {"name": "a", "workers": 4}, "seed": 0, "run_s": 10.0}
    results = {
        "scaling": {"rows": [shared, {**shared, "seed": 1, "run_s": 5.0}]},
        "outer": {"rows": [{**shared, "config": {"name": "b", "workers": 4}}]},
        "sync_every_lr": {"rows": [{**shared, "config": {"workers": 2}, "run_s": 99.0}]},
    }
    assert suite_time(results) == 15.0
