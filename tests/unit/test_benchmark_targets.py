"""The sync-round benchmark marks each configuration against the target its memory is held to."""

from __future__ import annotations

from benchmarks.rounds.sync_tables import (
    TARGET_WORKER_LOSSY_X,
    TARGET_WORKER_X,
    _marked_peak,
    worker_target_x,
)


def test_lossy_uploads_are_held_to_the_residuals_target() -> None:
    assert worker_target_x("bf16/fp32") == TARGET_WORKER_X == 3.0
    assert worker_target_x("fp32/fp32") == TARGET_WORKER_X
    assert worker_target_x("int4/int4") == TARGET_WORKER_LOSSY_X == 3.5
    assert worker_target_x("topk/int4") == TARGET_WORKER_LOSSY_X


def test_a_peak_between_the_targets_passes_only_for_a_lossy_row() -> None:
    model = 1_000_000
    peak = int(3.2 * model)
    assert _marked_peak(peak, model, worker_target_x("int4/int4")).endswith(" ok")
    assert _marked_peak(peak, model, worker_target_x("bf16/fp32")).endswith(" MISS")
