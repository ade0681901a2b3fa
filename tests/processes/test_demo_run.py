"""The demo end to end with tiny settings: it trains, reports and plots."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from diloco.demo import run as demo

pytestmark = pytest.mark.slow


@pytest.mark.timeout(240)
def test_demo_runs_and_reports(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    args = parser.parse_args(
        ["--workers", "2", "--steps", "20", "--sync-every", "10", "--out", str(tmp_path)]
    )
    assert demo.run(args) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["rounds"] == 2
    assert report["global_eval_loss"] < report["initial_eval_loss"]
    # Held-out against held-out, at the same inner steps: each round's global model and the
    # single worker after as many steps.
    assert [s for s, _ in report["global_curve"]] == [0, 10, 20]
    assert [s for s, _ in report["baseline_curve"]] == [0, 10, 20]
    assert report["baseline_curve"][-1][1] == report["baseline_eval_loss"]
    assert report["bytes_up"] > 0 and report["bytes_down"] > 0
    assert (tmp_path / "loss.png").stat().st_size > 10_000
    assert "global model" in capsys.readouterr().out


@pytest.mark.timeout(240)
def test_demo_runs_in_allreduce_mode(tmp_path: Path) -> None:
    """``diloco demo --allreduce``: the workers average among themselves; worker 0 evaluates
    the global model after each sync, since no server holds it."""
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    args = parser.parse_args(
        ["--workers", "2", "--steps", "20", "--sync-every", "10", "--out", str(tmp_path)]
        + ["--allreduce"]
    )
    assert demo.run(args) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["mode"] == "allreduce" and report["rounds"] == 2
    assert report["global_eval_loss"] < report["initial_eval_loss"]
    assert [s for s, _ in report["global_curve"]] == [0, 10, 20]
    # Only small JSON goes through the server; the tensors go between the workers.
    assert report["bytes_up"] == 0 and report["bytes_down"] == 0
    assert report["collective_bytes"] > 0
