"""Claim g as arXiv 2401.09135 states it: loss against wall-clock time, read as the simulated
time each configuration takes to reach the sync run's final loss (issue 32). Not run on its own
(``claims.py`` uses it; ``rules.py`` holds the rule).

Both sides come from the curves (the global model evaluated at every upload event, async, or
round close, sync, on the same held-out windows), so the target and the crossings are measured
alike: the target is the last point of sync's curve, sync's own time the first point at or below
it, and a configuration's time the first point of its curve at or below it (None: never).
Times are the simulated clock's (``benchmarks/harness/sim_clock.py``), paired by seed.
"""

from __future__ import annotations

import math
from typing import Any

from benchmarks.quality.stats import rows

REFERENCE = "sync"
# Claim g's row: async + DN + DyLU with a time budget (as long as sync's slowest worker takes for
# its steps) instead of sync's steps, since a run stopped at equal steps stops long before.
TIMED = "async + DN + DyLU, sync's time"


def time_to_loss(curve: list[dict[str, Any]], target: float) -> float | None:
    """Simulated time of the first curve point at or below ``target``; None if none is."""
    for point in curve:
        if point["eval_loss"] <= target:
            return float(point["wall_s"])
    return None


def reach_times(result: dict[str, Any], name: str) -> dict[int, tuple[float, float | None]]:
    """By seed: (sync's time to its own final loss, ``name``'s time to the same loss)."""
    out = {}
    syncs = {r["seed"]: r for r in rows(result, REFERENCE)}
    for row in rows(result, name):
        sync = syncs.get(row["seed"])
        if sync is None:
            continue
        target = sync["curve"][-1]["eval_loss"]
        own = time_to_loss(sync["curve"], target)
        assert own is not None  # its own last point is at the target
        out[row["seed"]] = (own, time_to_loss(row["curve"], target))
    return out


def ratios(times: dict[int, tuple[float, float | None]]) -> list[float]:
    """Per seed, in seed order: the configuration's time to sync's final loss over sync's own
    (infinity where it never got there), the numbers ``rules.RULES["g"]`` judges."""
    return [math.inf if t is None else t / own for _, (own, t) in sorted(times.items())]


def describe(times: dict[int, tuple[float, float | None]]) -> str:
    """Per-seed ratios of the time to sync's final loss over sync's ("never": not reached)."""
    parts = ["never" if t is None else f"{t / own:.2f}" for _, (own, t) in sorted(times.items())]
    return ", ".join(parts)
