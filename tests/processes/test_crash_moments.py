"""kill -9 of the server at each moment that matters, with ``--save-every 1``: no accepted step
is lost, none is counted twice, nothing hangs, and the restarted server always has a checkpoint.
The scenario and its ledger are in ``tests/helpers/crash_scenario.py``; ``benchmarks/faults/crash_moments.py``
runs it many times per moment."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.crash_scenario import MOMENTS, run

pytestmark = pytest.mark.slow


@pytest.mark.timeout(150)
@pytest.mark.parametrize("moment", MOMENTS)
def test_server_kill9_at_this_moment_loses_no_accepted_step(tmp_path: Path, moment: str) -> None:
    out = run(tmp_path, moment)
    assert out.killed, "the server was not killed at the moment"
    assert not out.hung, "the worker hung"
    assert not out.errors, out.errors
    assert out.resumed, "the restarted server loaded no checkpoint"
    assert out.dropped == 0  # with --save-every 1 no step needs dropping
    assert out.missing == pytest.approx(0.0, abs=1e-3), f"{out.missing} steps lost or doubled"
    assert out.exact, "some elements moved by other than the steps taken"
    assert out.in_sync, "the worker's model differs from the served parameters"
