"""Helpers of the older sweep scripts (``training/async_experiment``,
``training/streaming_experiment``, ``codecs/quality``): every configuration for every seed
through ``trials.run_trial``, rows grouped by configuration, mean ± spread."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterator
from typing import Any

from benchmarks.harness.trials import Trial, run_trial


def run_trials(
    configurations: Callable[[Any, int], list[Trial]], args: Any
) -> Iterator[tuple[int, Trial, dict[str, Any]]]:
    """Every configuration ``configurations(args, seed)`` names, for every seed in
    ``args.seeds``, in that order, but only those ``args.only`` names (when given): each as
    ``(seed, trial, run_trial(trial))``."""
    for seed in args.seeds:
        for trial in configurations(args, seed):
            if args.only and trial.name not in args.only:
                continue
            yield seed, trial, run_trial(trial)


def per_worker_budget(args: Any, seed: int) -> dict[str, Any]:
    """The ``Trial`` fields a sweep's configurations share when each worker trains
    ``args.steps`` steps: ``seed``, ``args.workers``, ``args.sync_every`` and the total."""
    return {
        "seed": seed,
        "workers": args.workers,
        "sync_every": args.sync_every,
        "total_steps": args.steps * args.workers,
    }


def by_name(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Rows (one per configuration and seed) grouped by configuration, in run order."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(r["name"], []).append(r)
    return groups


def summarise(rows: list[dict[str, Any]], key: str) -> str:
    """``key`` over the seeds' rows: the value, or mean ± standard deviation."""
    values = [r[key] for r in rows]
    if len(values) == 1:
        return f"{values[0]:.4f}"
    return f"{statistics.mean(values):.4f} ± {statistics.stdev(values):.4f}"
