"""Dynamic Local Updates (DyLU, arXiv 2401.09135): slower workers take fewer inner steps per
sync, so every worker hands in work at about the same wall-clock rate.

    H_w = max(floor(v_w / v_max * H_base), H_min)

Speeds are smoothed (an exponential moving average that ignores missing or non-positive
samples), so one slow measurement, such as the step rate right after a sync, does not make the
recommendation flap.
"""

from __future__ import annotations

import math
from collections.abc import Mapping


def smooth_speed(previous: float | None, sample: float | None, alpha: float = 0.3) -> float | None:
    """Exponential moving average of steps per second; a missing or non-positive sample (a
    worker that spent the whole interval syncing) leaves the estimate unchanged."""
    if not 0 < alpha <= 1:
        raise ValueError(f"alpha must be in (0, 1], got {alpha}")
    if sample is None or not math.isfinite(sample) or sample <= 0:
        return previous
    if previous is None:
        return sample
    return (1 - alpha) * previous + alpha * sample


def recommended_sync_every(
    speeds: Mapping[str, float | None], base: int, minimum: int = 1
) -> dict[str, int]:
    """H per worker from smoothed speeds. Workers without a speed yet get ``base``."""
    if base < 1 or minimum < 1:
        raise ValueError("base and minimum must be >= 1")
    known = [v for v in speeds.values() if v is not None and v > 0]
    if not known:
        return {w: base for w in speeds}
    fastest = max(known)
    return {
        w: base if v is None or v <= 0 else max(math.floor(v / fastest * base), minimum)
        for w, v in speeds.items()
    }
