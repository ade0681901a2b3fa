"""Small statistics over the suite's result files: final losses by configuration and seed,
paired differences, mean and spread. Not run on its own (``render.py`` and ``claims.py`` use it).

The spread is the sample standard deviation over seeds (0 with one seed). Differences between two
configurations are paired by seed (same pretrained start, same data order), so the spread of a
difference is that of the per-seed differences, not of the two losses.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

Results = dict[str, dict[str, Any]]


def load(out_dir: Path) -> Results:
    """Every ``NAME.json`` result file in ``out_dir``, by experiment name."""
    results = {}
    for path in sorted(out_dir.glob("*.json")):
        data = json.loads(path.read_text())
        if isinstance(data, dict) and "experiment" in data:
            results[data["experiment"]] = data
    return results


def names(result: dict[str, Any]) -> list[str]:
    """Configuration names in run order (the first is the experiment's reference)."""
    return list(dict.fromkeys(r["name"] for r in result["rows"]))


def rows(result: dict[str, Any], name: str) -> list[dict[str, Any]]:
    return [r for r in result["rows"] if r["name"] == name]


def values(result: dict[str, Any], name: str, key: str = "eval_loss") -> dict[int, float]:
    """``key`` of configuration ``name`` by seed."""
    return {r["seed"]: float(r[key]) for r in rows(result, name)}


def mean_sd(xs: list[float]) -> tuple[float, float]:
    if not xs:
        return math.nan, math.nan
    return statistics.mean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0


def paired(result: dict[str, Any], name: str, reference: str) -> list[float]:
    """Per-seed ``loss(name) - loss(reference)`` (negative: ``name`` is better)."""
    a, b = values(result, name), values(result, reference)
    return [a[s] - b[s] for s in sorted(a) if s in b]


def fmt(xs: list[float], digits: int = 3, signed: bool = False) -> str:
    """``mean ± sd`` of ``xs``."""
    m, sd = mean_sd(xs)
    sign = "+" if signed else ""
    return f"{m:{sign}.{digits}f} ± {sd:.{digits}f}"


def ppl_change(diffs: list[float]) -> list[float]:
    """Loss differences (nats per byte) as per-seed perplexity changes in percent."""
    return [100 * (math.exp(d) - 1) for d in diffs]


def fmt_ppl(diffs: list[float]) -> str:
    """Perplexity change in percent, mean ± sd; "diverged" past 5 nats (a factor of 148)."""
    if any(abs(d) > 5 for d in diffs):
        return "diverged"
    return fmt(ppl_change(diffs), 1, signed=True) + " %"


def curve_at(row: dict[str, Any], fraction: float) -> float:
    """Eval loss of the first curve point at or past ``fraction`` of the row's inner steps."""
    curve = row["curve"]
    last = curve[-1]["steps_per_worker"]
    for point in curve:
        if point["steps_per_worker"] >= fraction * last:
            return float(point["eval_loss"])
    return float(curve[-1]["eval_loss"])


def up_per_round(row: dict[str, Any]) -> float:
    """Bytes one worker uploaded per outer update: what the server received over updates and
    workers."""
    return float(row["bytes_up"]) / (row["updates"] * row["config"]["workers"])


def down_per_round(row: dict[str, Any]) -> float:
    """Bytes one worker downloaded per round, its joining download (full parameters, once per
    run whatever the downlink) left out: mean over the workers of (bytes down - join) / rounds.
    All-reduce rows (``collective``): what the collectives brought each member, per round."""
    if row.get("collective"):
        return float(row["bytes_down"]) / (row["updates"] * row["config"]["workers"])
    per = [(w["bytes_down"] - w["join_bytes_down"]) / w["rounds"] for w in row["workers"]]
    return statistics.mean(per)


def per_round(result: dict[str, Any], name: str, direction: str) -> float:
    """Mean over seeds of ``up_per_round`` (``direction`` "up") or ``down_per_round``."""
    of = up_per_round if direction == "up" else down_per_round
    return statistics.mean(of(r) for r in rows(result, name))
