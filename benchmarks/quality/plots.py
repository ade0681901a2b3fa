"""The suite's PNG plots: eval loss of the global model against inner steps per worker, against
inner steps of all workers (tokens, where equal-tokens baselines are compared), against bytes
sent, and for async runs against wall time. Not run on its own (``render.py`` uses it).
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FuncFormatter, NullFormatter  # noqa: E402

from benchmarks.quality.stats import names, rows  # noqa: E402

PANELS = {
    "steps_per_worker": "inner steps per worker",
    "total_steps": "inner steps of all workers (= tokens / 1024)",
    "bytes_up": "bytes sent by all workers (MB, log scale)",
    "wall_s": "wall time (s, simulated worker speeds)",
}
# Experiments whose baselines take more steps than a worker (equal tokens): a tokens panel.
TOKEN_PANELS = {"scaling", "data_parallel"}


def _x(row: dict[str, Any], point: dict[str, Any], x: str) -> float:
    """The abscissa ``x`` of one curve point of ``row``."""
    # Streaming workers hand in their unsent fragments when they stop: updates past the last
    # step, which ``updates * H / P`` would count as steps. No point lies past the run's end.
    steps = min(point["steps_per_worker"], row.get("steps_per_worker", math.inf))
    if x == "steps_per_worker":
        return steps
    if x == "total_steps":
        config = row["config"]
        return steps * max(config["workers"], config.get("replicas", 1))
    if x == "bytes_up":
        return point["bytes_up"] / 1e6
    return float(point[x])


def _lines(ax: Any, result: dict[str, Any], name: str, x: str, color: Any, label: str) -> None:
    """Sync runs share their curve points across seeds: the mean line and a min-max band.
    Async points differ per seed (the clock's jitter is drawn from it): one thin line per seed."""
    group = [r for r in rows(result, name) if r.get("curve")]
    if x == "bytes_up":  # the start (nothing sent yet) has no place on a log axis
        group = [{**r, "curve": [p for p in r["curve"] if p["bytes_up"] > 0]} for r in group]
    if result["experiment"].startswith("async"):
        for j, row in enumerate(group):
            xs = [_x(row, p, x) for p in row["curve"]]
            ys = [p["eval_loss"] for p in row["curve"]]
            ax.plot(xs, ys, color=color, lw=1, alpha=0.8, label=label if j == 0 else None)
        return
    n = min(len(r["curve"]) for r in group)
    xs = [statistics.mean(_x(r, r["curve"][i], x) for r in group) for i in range(n)]
    ys = [[r["curve"][i]["eval_loss"] for r in group] for i in range(n)]
    ax.plot(xs, [statistics.mean(y) for y in ys], color=color, lw=1.6, label=label,
            marker="." if n < 40 else None)  # fmt: skip
    if len(group) > 1:
        lo, hi = [min(y) for y in ys], [max(y) for y in ys]
        ax.fill_between(xs, lo, hi, color=color, alpha=0.15, linewidth=0)


def plot_experiment(result: dict[str, Any], path: Path, title: str) -> bool:
    """Write ``path``; True when some curve was clipped at the top of the axes."""
    exp = result["experiment"]
    panels = ["steps_per_worker"]
    panels += ["total_steps"] if exp in TOKEN_PANELS else []
    panels += ["bytes_up"] + (["wall_s"] if exp.startswith("async") else [])
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.2), squeeze=False)
    colors = plt.get_cmap("tab10")
    starts = [r["curve"][0]["eval_loss"] for r in result["rows"]]
    top = max(starts) + 0.05
    bottom = min(min(p["eval_loss"] for p in r["curve"]) for r in result["rows"]) - 0.02
    clipped = any(p["eval_loss"] > top for r in result["rows"] for p in r["curve"])
    for ax, x in zip(axes[0], panels, strict=True):
        for i, name in enumerate(names(result)):
            sample = rows(result, name)[0]
            if x == "bytes_up" and not sample.get("bytes_up"):
                continue  # one worker sends nothing: no point on a log axis
            if x == "steps_per_worker" and "x steps" in name and len(panels) > 2:
                continue  # equal-tokens baselines: in the tokens panel, beside M workers
            label = name + (" (computed)" if x == "bytes_up" and sample["kind"] == "dp" else "")
            _lines(ax, result, name, x, colors(i % 10), label)
        if x == "bytes_up":
            ax.set_xscale("log")
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel(PANELS[x])
        ax.set_ylabel("held-out eval loss (nats per byte)")
        ax.set_ylim(bottom, top)
        ax.grid(alpha=0.3)
    # The legend of the panel that shows every configuration.
    handles, labels = max((a.get_legend_handles_labels() for a in axes[0]), key=lambda h: len(h[1]))
    ncol = min(len(labels), 3)
    fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize=8, frameon=False)
    seeds = len(result["seeds"])
    if seeds == 1:
        how = "one seed"
    elif exp.startswith("async"):
        how = f"one line per seed, {seeds} seeds"
    else:
        how = f"line: mean over {seeds} seeds, band: min to max"
    fig.suptitle(f"{title}: held-out loss of the global model ({how})", fontsize=10)
    fig.tight_layout(rect=(0, 0.06 * -(-len(labels) // ncol), 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return clipped
