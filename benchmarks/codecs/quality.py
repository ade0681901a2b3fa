"""Fewer bytes at equal loss? Eval loss and bytes per round of each uplink codec on the demo model.

    python -m benchmarks.codecs.quality --seeds 0 1 2
    python -m benchmarks.codecs.quality --smoke     # 2 workers, 2 rounds, 2 configurations

Four workers, a sync server, the same inner steps per worker in every configuration (the
streaming experiment's set-up: ``harness.trials.run_trial``, worker threads training the demo
model on their own non-iid shard). Configurations: the uplink codec (fp32, bf16, int8, int4,
low rank) with error feedback, and the lossy ones once more without it, all with today's fp32
downlink; then compressed downlinks (bf16, int8, int4 updates) beside the smaller uplinks. Reported per configuration: eval loss of the final global model (mean ± standard
deviation over seeds), bytes one worker sends up and receives down per round, and their sum
against the bf16-up / fp32-down configuration (the reference design's bytes).

The issue's target (issue 18): the smallest configuration whose loss is within the seed spread
of bf16-up / fp32-down moves at least 4x fewer bytes per worker per round than it.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

from benchmarks.harness import smoke
from benchmarks.harness.report import print_table, write_json
from benchmarks.harness.sweeps import by_name, per_worker_budget, run_trials, summarise
from benchmarks.harness.trials import Trial

REFERENCE = "up bf16, down fp32"
DOWNLINKS = [
    ("bf16", "bf16"),
    ("bf16", "int8"),
    ("int8", "int8"),
    ("int4", "int8"),
    ("int4", "int4"),
    ("lowrank", "int8"),
]


def configurations(args: argparse.Namespace, seed: int) -> list[Trial]:
    common = per_worker_budget(args, seed)
    trials = []
    for codec in ("fp32", "bf16", "int8", "int4", "lowrank"):
        feedbacks = (True, False) if codec in ("int8", "int4", "lowrank") else (True,)
        for feedback in feedbacks:
            name = f"up {codec}, down fp32" + ("" if feedback else ", no feedback")
            worker: dict[str, Any] = {"codec": codec}
            if not feedback:
                worker["error_feedback"] = False
            trials.append(Trial(name, worker=worker, **common))
    # The downlink: each round published as an update quantized with the server's own error
    # feedback (``--download-codec``), beside the smaller uplinks.
    for up, down in DOWNLINKS:
        name = f"up {up}, down {down}"
        trials.append(Trial(name, worker={"codec": up}, server={"download_codec": down}, **common))
    return trials


def per_round(row: dict[str, Any], key: str) -> float:
    """Bytes one worker moved in a round that was not its first (``key``: ``last_bytes_up`` or
    ``last_bytes_down``, the last sync's), averaged over workers: the join's full download is
    left out, so a compressed downlink is measured by its updates."""
    values = [w[key] for w in row["workers"] if w.get("rounds")]
    return statistics.mean(values) if values else float("nan")


def table(rows: list[dict[str, Any]]) -> None:
    """Per configuration: eval loss over seeds, its paired difference from the reference on the
    same seed (the seeds' spread is mostly the data split's, which every configuration shares),
    bytes per worker per round each way, and how many times fewer than the reference."""
    for row in rows:
        row["up_per_round"] = per_round(row, "last_bytes_up")
        row["down_per_round"] = per_round(row, "last_bytes_down")
    ref = {r["seed"]: r for r in rows if r["name"] == REFERENCE}
    ref_bytes = (
        statistics.mean(r["up_per_round"] + r["down_per_round"] for r in ref.values())
        if ref
        else float("nan")
    )
    ref_sd = statistics.stdev(r["eval_loss"] for r in ref.values()) if len(ref) > 1 else 0.0
    out = []
    for name, group in by_name(rows).items():
        up = statistics.mean(r["up_per_round"] for r in group)
        down = statistics.mean(r["down_per_round"] for r in group)
        diffs = [r["eval_loss"] - ref[r["seed"]]["eval_loss"] for r in group if r["seed"] in ref]
        paired = (
            f"{statistics.mean(diffs):+.4f} ± {statistics.stdev(diffs):.4f}"
            if len(diffs) > 1
            else "n/a"
        )
        out.append(
            [
                name,
                summarise(group, "eval_loss"),
                paired,
                f"{up / 1e3:.1f}",
                f"{down / 1e3:.1f}",
                f"{ref_bytes / (up + down):.2f}x",
            ]
        )
    print()
    print_table(
        ["configuration", "eval loss", "vs ref, paired", "up kB", "down kB", "fewer bytes"], out
    )
    print(f"\nreference ({REFERENCE}) spread over seeds: standard deviation {ref_sd:.4f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--steps", type=int, default=300, help="inner steps per worker")
    p.add_argument("--sync-every", type=int, default=25)
    p.add_argument("--only", nargs="*", help="run only configurations with these names")
    p.add_argument("--out", default="benchmarks/results/codec_quality.json")
    p.add_argument("--summarise", metavar="JSON", help="print the table of an earlier run's file")
    smoke.add_flag(p)
    args = p.parse_args(argv)
    if args.smoke:  # the reference and int8 both ways: 2 workers, 2 rounds, one seed
        args.seeds, args.workers, args.steps, args.sync_every = [0], 2, 20, 10
        args.only, args.out = [REFERENCE, "up int8, down int8"], None
    if args.summarise:
        table(json.loads(Path(args.summarise).read_text())["rows"])
        return 0
    rows: list[dict[str, Any]] = []
    for seed, trial, row in run_trials(configurations, args):
        rows.append(row)
        print(
            f"seed {seed}  {trial.name:<34} eval {row['eval_loss']:.4f}  "
            f"up {per_round(row, 'last_bytes_up') / 1e3:7.1f} kB/round  "
            f"down {per_round(row, 'last_bytes_down') / 1e3:7.1f} kB/round  "
            f"wall {row['wall_s']:5.1f} s",
            flush=True,
        )
    table(rows)
    if args.out:
        write_json(args.out, {"args": vars(args), "rows": rows})
    if args.smoke:
        check_smoke(rows)
    return 0


def check_smoke(rows: list[dict[str, Any]]) -> None:
    """Both configurations trained to a finite loss, and int8 moved fewer bytes each way."""
    by = {r["name"]: r for r in rows}
    smoke.require(set(by) == {REFERENCE, "up int8, down int8"}, f"both ran: {set(by)}")
    for r in rows:
        smoke.require(math.isfinite(r["eval_loss"]) and r["eval_loss"] > 0, "a finite loss")
        smoke.require(r["updates"] >= 1, f"{r['name']}: outer updates happened")
    ref, int8 = by[REFERENCE], by["up int8, down int8"]
    smoke.require(int8["up_per_round"] < ref["up_per_round"], "int8 uploads fewer bytes")
    smoke.require(int8["down_per_round"] < ref["down_per_round"], "int8 downloads fewer bytes")
    smoke.passed("codecs.quality")


if __name__ == "__main__":
    sys.exit(main())
