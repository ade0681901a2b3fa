"""The quality suite (benchmarks/quality/, issue 20) in its fast setting: every experiment runs
through the real server and workers, its results file has the expected shape, and the docs page
renders with one claims row per claim a-q (the one-GPU profile is not part of a bare run). No
loss value is asserted: at this size a figure could fail by chance."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from benchmarks.quality.experiments import FAST
from benchmarks.quality.reach import TIMED
from benchmarks.quality.stats import down_per_round, up_per_round
from benchmarks.quality.suite import APART, EXPERIMENTS
from benchmarks.quality.tuning import EXTEND, lr_kind

BENCHMARKS = Path(__file__).parents[2] / "benchmarks"

pytestmark = pytest.mark.slow


ROW_KEYS = {"name", "seed", "kind", "config", "eval_loss", "wall_s", "bytes_up", "curve", "run_s"}


POINT_KEYS = {"steps_per_worker", "bytes_up", "wall_s", "eval_loss"}


def check_result(name: str, result: dict) -> None:
    exp = EXPERIMENTS[name]
    assert result["experiment"] == name and result["claims"] == exp.claims
    assert result["fast"] is True and result["seeds"] == [0]
    configs = [c.name for c in exp.configs(FAST)]
    # One row per configuration and seed, in order.
    assert [(r["name"], r["seed"]) for r in result["rows"]] == [(c, 0) for c in configs]
    # Every row at the lr the sweep chose for its kind (issue 32).
    assert [r["config"]["lr"] for r in result["rows"]] == [
        result["inner_lr"][lr_kind(c)] for c in exp.configs(FAST)
    ]
    for row in result["rows"]:
        assert ROW_KEYS <= row.keys(), (name, row["name"], ROW_KEYS - row.keys())
        for key in ("eval_loss", "wall_s", "bytes_up", "run_s"):
            assert math.isfinite(row[key]) and row[key] >= 0, (name, row["name"], key)
        curve = row["curve"]
        assert curve, (name, row["name"])
        for point in curve:
            assert POINT_KEYS <= point.keys()
            assert all(math.isfinite(point[k]) for k in POINT_KEYS)
        # Curves and the table on the same held-out windows: the last point is the final figure.
        assert curve[-1]["eval_loss"] == pytest.approx(row["eval_loss"]), (name, row["name"])
        steps = [p["steps_per_worker"] for p in curve]
        assert steps == sorted(steps) and steps[-1] > 0, (name, row["name"], steps)
        sent = [p["bytes_up"] for p in curve]
        assert sent == sorted(sent), (name, row["name"], sent)


def check_sparse(result: dict) -> None:
    """Claim n's rows measure both directions: every worker's joining download apart from its
    rounds', and with the sparse downlink the rounds came down as updates, fewer bytes than
    full parameters."""
    by_name = {r["name"]: r for r in result["rows"]}
    for row in by_name.values():
        for w in row["workers"]:
            assert 0 < w["join_bytes_down"] < w["bytes_down"] and w["rounds"] > 0, row["name"]
    fp32, sparse = by_name["fp32"], by_name["topk + EF, SparseLoCo rule, sparse downlink"]
    assert all(w["update_downloads"] == w["rounds"] for w in sparse["workers"])
    assert all(w["update_downloads"] == 0 for w in fp32["workers"])
    assert down_per_round(sparse) < down_per_round(fp32) / 5
    assert up_per_round(sparse) < up_per_round(fp32) / 20


def check_async(result: dict, sweep: dict, page: str) -> None:
    """The async DN rows train at the outer lr the outer sweep chose on the validation split
    (naive async keeps 0.7), and the page prints that sweep."""
    outer = sweep["async_outer"]
    assert result["outer_lr"] == outer["lr"]
    # The list's points, and at most EXTEND beyond an end where the best lay there.
    tried = [x for x, _ in outer["losses"]]
    assert set(FAST.async_lrs) <= set(tried)
    assert len(tried) <= len(FAST.async_lrs) + EXTEND
    by_name = {r["name"]: r["config"]["server"] for r in result["rows"]}
    assert by_name["async (naive)"]["outer_lr"] == 0.7
    for name in ("async + DN", "async + DN + DyLU", TIMED):
        assert by_name[name]["outer_lr"] == outer["lr"], name
    assert "The async experiment's outer lr" in page


@pytest.mark.timeout(180)
def test_every_experiment_runs_fast_and_renders(tmp_path: Path) -> None:
    out, docs = tmp_path / "results", tmp_path / "docs"
    cmd = [
        sys.executable,
        str(BENCHMARKS / "quality" / "run.py"),
        "--fast",
        "--out",
        str(out),
        "--render",
        str(docs),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=170)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    suite = [n for n in EXPERIMENTS if n not in APART]
    for name in suite:
        check_result(name, json.loads((out / f"{name}.json").read_text()))
    check_sparse(json.loads((out / "sparse.json").read_text()))
    page = (docs / "quality.md").read_text()
    claim_rows = [line for line in page.splitlines() if line.startswith("| ") and ". " in line]
    letters = [line[2] for line in claim_rows if line[3:5] == ". "]
    assert letters == list("abcdefghijklmnopq"), letters
    assert "fast-setting results" in page
    assert "## One-GPU profile (not run)" in page
    sweep = json.loads((out / "lr_sweep.json").read_text())
    check_async(json.loads((out / "async.json").read_text()), sweep, page)
    for name in suite:
        png = docs / "quality" / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
