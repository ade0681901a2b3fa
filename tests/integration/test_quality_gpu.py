"""The one-GPU profile's wiring (benchmarks/quality/gpu.py, issue 32 item 5) on the CPU at the
fast scale: one command runs its configurations, writes ``gpu_profile.json``, stops at its time
limit, and the page's section shows the run. The profile's own model and corpus are built in
test_quality_suite.py; no loss value is asserted."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
from benchmarks.quality import run
from benchmarks.quality.experiments import FAST, plain
from benchmarks.quality.gpu import GPU_SCALE, gpu_profile, section
from benchmarks.quality.protocol import FAST as FAST_PROFILE
from benchmarks.quality.rows import run_config
from benchmarks.quality.stats import load
from benchmarks.quality.suite import APART, EXPERIMENTS


def test_the_profile_is_one_configuration_at_its_own_scale() -> None:
    """DiLoCo M=4 at H=50 for 2000 inner steps after a 2000-step pretrain, beside one-worker
    AdamW; kept out of the CPU suite's bare run."""
    exp = EXPERIMENTS["gpu_profile"]
    assert exp.scale is GPU_SCALE and "gpu_profile" in APART
    adamw, diloco = gpu_profile(GPU_SCALE)
    assert (adamw.kind, adamw.steps) == ("adamw", 2000)
    assert (diloco.kind, diloco.workers, diloco.sync_every, diloco.steps) == ("diloco", 4, 50, 2000)
    assert GPU_SCALE.pretrain_steps == 2000


@pytest.mark.timeout(240)
def test_one_command_writes_its_json_and_the_page_shows_it(tmp_path: Path) -> None:
    assert run.main(["gpu_profile", "--fast", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "gpu_profile.json").read_text())
    assert [r["name"] for r in result["rows"]] == [c.name for c in gpu_profile(FAST)]
    assert result["skipped"] == [] and not any(r.get("stopped_early") for r in result["rows"])
    assert all(math.isfinite(r["eval_loss"]) for r in result["rows"])
    # Not swept (the CPU suite's sweep is not run at its scale): every row at the profile's lr.
    assert result["inner_lr"] == {} and not (tmp_path / "lr_sweep.json").exists()
    assert {r["config"]["lr"] for r in result["rows"]} == {None}
    page = "\n".join(section(load(tmp_path)))
    assert "## One-GPU profile\n" in page and "Fast-setting results" in page
    assert "| DiLoCo M=2 |" in page and "| AdamW, 1 worker (equal steps) |" in page
    assert "(not run)" in "\n".join(section({}))


@pytest.mark.timeout(240)
def test_the_time_limit_stops_training_and_skips_what_has_not_begun(tmp_path: Path) -> None:
    """Past the limit the running row stops at its next curve point and the rest are skipped;
    a stopped row is not cached (a later run without the limit trains it in full)."""
    out = tmp_path / "limited"
    assert run.main(["gpu_profile", "--fast", "--out", str(out), "--time-limit", "0.001"]) == 0
    result = json.loads((out / "gpu_profile.json").read_text())
    (row,) = result["rows"]
    assert row["stopped_early"] and row["steps_per_worker"] == FAST.sync_every < FAST.steps
    assert result["skipped"] == ["DiLoCo M=2 (seed 0)"]
    assert "--time-limit 0.001" in result["command"]
    assert not list((out / "cache" / "rows").glob("*.json"))


@pytest.mark.timeout(240)
def test_a_diloco_row_past_its_deadline_stops_after_one_round(tmp_path: Path) -> None:
    """Workers check the deadline at their sync boundaries only: with it already passed, each
    trains one round of H steps and leaves."""
    config = plain(FAST)
    row = run_config(config, FAST_PROFILE, 0, FAST, tmp_path, deadline=time.monotonic())
    assert row["stopped_early"] and row["steps_per_worker"] == FAST.sync_every
    assert row["updates"] == 1 and math.isfinite(row["eval_loss"])
