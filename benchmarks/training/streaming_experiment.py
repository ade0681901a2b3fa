"""Streaming DiLoCo against plain DiLoCo on the demo model (arXiv 2501.18512 in small).

    python -m benchmarks.training.streaming_experiment --seeds 0 1 2 --fragments 4
    python -m benchmarks.training.streaming_experiment --smoke   # plain and one streaming row

Four workers, sync server, the same inner steps per worker in every configuration. Plain DiLoCo
sends the whole model every ``sync_every`` steps; streaming sends one of P fragments every
``sync_every / P`` steps, with overlap tau in {0, 1} and merge factor alpha in {0, 0.5}, fragments
cut sequentially or strided. Reported per configuration: eval loss of the final global model
(mean ± standard deviation over seeds), the peak bytes one worker uploads in one sync, total bytes
up, and wall-clock time. Printed, and written as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import itertools
import math
import statistics
import sys
from typing import Any

from benchmarks.harness import smoke
from benchmarks.harness.report import print_table, write_json
from benchmarks.harness.sweeps import by_name, per_worker_budget, run_trials, summarise
from benchmarks.harness.trials import Trial


def configurations(args: argparse.Namespace, seed: int) -> list[Trial]:
    common = per_worker_budget(args, seed)
    trials = [Trial("plain", worker={"bf16_comm": not args.fp32}, **common)]
    for pattern, tau, alpha in itertools.product(("sequential", "strided"), (0, 1), (0.0, 0.5)):
        trials.append(
            Trial(
                f"P={args.fragments} {pattern[:3]} tau={tau} alpha={alpha}",
                worker={
                    "bf16_comm": not args.fp32,
                    "num_fragments": args.fragments,
                    "fragment_pattern": pattern,
                    "overlap_steps": tau,
                    "merge_alpha": alpha,
                },
                **common,
            )
        )
    return trials


def peak_sync_bytes(row: dict[str, Any]) -> float:
    """The most bytes one worker uploaded in one sync (plain: its upload size)."""
    peaks = []
    for w in row["workers"]:
        if "peak_sync_bytes_up" in w:
            peaks.append(w["peak_sync_bytes_up"])
        elif w.get("rounds"):
            peaks.append(w["bytes_up"] / w["rounds"])
    return max(peaks) if peaks else float("nan")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--steps", type=int, default=300, help="inner steps per worker")
    p.add_argument("--sync-every", type=int, default=24)
    p.add_argument("--fragments", type=int, default=4)
    p.add_argument("--fp32", action="store_true", help="send fp32 pseudo-gradients")
    p.add_argument("--only", nargs="*", help="run only configurations with these names")
    p.add_argument("--out", default="benchmarks/results/streaming_experiment.json")
    smoke.add_flag(p)
    args = p.parse_args(argv)
    if args.smoke:  # plain and one streaming configuration: 2 workers, 2 rounds of 4 fragments
        args.seeds, args.workers, args.steps, args.sync_every, args.fragments = [0], 2, 16, 8, 4
        args.only, args.out = ["plain", "P=4 str tau=1 alpha=0.5"], None
    rows: list[dict[str, Any]] = []
    for seed, trial, row in run_trials(configurations, args):
        row["peak_sync_bytes"] = peak_sync_bytes(row)
        row["bytes_up"] = sum(w["bytes_up"] for w in row["workers"])
        rows.append(row)
        print(
            f"seed {seed}  {trial.name:<32} eval {row['eval_loss']:.4f}  "
            f"peak sync {row['peak_sync_bytes'] / 1e3:8.1f} kB  "
            f"up {row['bytes_up'] / 1e6:6.2f} MB  wall {row['wall_s']:5.1f} s",
            flush=True,
        )
    table = []
    for name, group in by_name(rows).items():
        table.append(
            [
                name,
                summarise(group, "eval_loss"),
                f"{statistics.mean(r['peak_sync_bytes'] for r in group) / 1e3:.1f}",
                f"{statistics.mean(r['bytes_up'] for r in group) / 1e6:.2f}",
                summarise(group, "wall_s"),
            ]
        )
    print()
    print_table(["configuration", "eval loss", "peak kB/sync", "MB up", "wall s"], table)
    if args.out:
        write_json(args.out, {"args": vars(args), "rows": rows})
    if args.smoke:
        by = {r["name"]: r for r in rows}
        smoke.require(len(by) == 2, f"both configurations ran: {list(by)}")
        for r in rows:
            smoke.require(math.isfinite(r["eval_loss"]), f"{r['name']}: a finite loss")
        plain, stream = by["plain"], by["P=4 str tau=1 alpha=0.5"]
        smoke.require(
            stream["peak_sync_bytes"] < plain["peak_sync_bytes"] / 2, "fragments send less per sync"
        )
        smoke.passed("streaming_experiment")
    return 0


if __name__ == "__main__":
    sys.exit(main())
