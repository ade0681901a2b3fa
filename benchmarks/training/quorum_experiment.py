"""One straggler: sync DiLoCo behind the full barrier against quorum rounds (``--quorum``, the
adaptive grace window, late uploads merged), on the demo model.

    python -m benchmarks.training.quorum_experiment --seeds 0 1 2 --unit 0.02
    python -m benchmarks.training.quorum_experiment --smoke   # all three, 40 steps, 1 ms units

Four workers sleep after every step for ``unit`` times 1, 1, 1 and 4 seconds (one worker at a
quarter of the others' speed), on top of the step's compute, until ``--total-steps`` local
steps are spent by all together. The barrier waits for the straggler every round, so each
worker takes a quarter of them; quorum rounds close on the 3 fast workers plus the grace window
and merge the straggler's uploads into a later round, weighted 1/sqrt(1 + lateness), so the
fast workers take more; an upload more than ``--max-lateness`` rounds late (default 1, and 4 in
the third configuration) is refused and the straggler rebases, its steps kept for its next
upload. Reported per configuration: eval loss of the final global model (mean ± standard deviation over seeds),
wall-clock time, outer updates, the straggler's uploads merged late and refused, steps dropped.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from typing import Any

from benchmarks.harness import smoke
from benchmarks.harness.report import print_table, write_json
from benchmarks.harness.sweeps import by_name, run_trials, summarise
from benchmarks.harness.trials import Trial

RATIO = (1.0, 1.0, 1.0, 4.0)


def configurations(args: argparse.Namespace, seed: int) -> list[Trial]:
    common: dict[str, Any] = {
        "seed": seed,
        "workers": len(RATIO),
        "sync_every": args.sync_every,
        "delays": [args.unit * r for r in RATIO],
        "total_steps": args.total_steps,
        "shared_budget": True,  # the run ends when the steps are spent, by whoever took them
    }
    outer = {"outer_lr": args.outer_lr, "outer_momentum": 0.9}
    quorum = {"quorum": "3", "grace": "auto", "upload_slots": 2, **outer}
    return [
        Trial("sync barrier", server=outer, **common),
        Trial("quorum 3 of 4, auto grace", server=quorum, **common),
        # The straggler's uploads arrive about 3 rounds late: merged only within max_lateness.
        Trial("quorum 3 of 4, max lateness 4", server={**quorum, "max_lateness": 4}, **common),
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--unit", type=float, default=0.02, help="seconds; delays are unit * ratio")
    p.add_argument("--total-steps", type=int, default=800)
    p.add_argument("--sync-every", type=int, default=20)
    p.add_argument("--outer-lr", type=float, default=0.7)
    p.add_argument("--only", nargs="*", help="run only configurations with these names")
    p.add_argument("--out", default="benchmarks/results/quorum_experiment.json")
    smoke.add_flag(p)
    args = p.parse_args(argv)
    if args.smoke:  # 10 steps per worker, 1 ms units
        args.seeds, args.unit, args.total_steps, args.sync_every = [0], 0.001, 40, 5
        args.out = None
    rows: list[dict[str, Any]] = []
    for seed, trial, row in run_trials(configurations, args):
        straggler = row["workers"][-1]
        row["late_merges"] = straggler["late_merges"]
        row["refused"] = straggler["refused_submissions"]
        row["dropped_steps"] = sum(w["dropped_steps"] for w in row["workers"])
        rows.append(row)
        print(
            f"seed {seed}  {trial.name:<26} eval {row['eval_loss']:.4f}  "
            f"wall {row['wall_s']:6.1f} s  updates {row['updates']:4d}  "
            f"straggler: late {row['late_merges']} refused {row['refused']}  "
            f"dropped steps {row['dropped_steps']}",
            flush=True,
        )
    table = [
        [
            name,
            summarise(group, "eval_loss"),
            summarise(group, "wall_s"),
            f"{statistics.mean(r['updates'] for r in group):.1f}",
            f"{statistics.mean(r['late_merges'] for r in group):.1f}",
            f"{statistics.mean(r['refused'] for r in group):.1f}",
            f"{statistics.mean(r['dropped_steps'] for r in group):.1f}",
        ]
        for name, group in by_name(rows).items()
    ]
    print()
    print_table(
        ["configuration", "eval loss", "wall s", "updates", "late", "refused", "dropped"], table
    )
    if args.out:
        write_json(args.out, {"args": vars(args), "rows": rows})
    if args.smoke:
        for r in rows:
            smoke.require(math.isfinite(r["eval_loss"]), f"{r['name']}: a finite loss")
            smoke.require(r["updates"] >= 1, f"{r['name']}: outer updates happened")
            smoke.require(r["steps"] == args.total_steps, f"{r['name']}: the budget was spent")
            smoke.require(r["dropped_steps"] == 0, f"{r['name']}: no step dropped")
        smoke.require(len(rows) == 3, "every configuration ran")
        smoke.passed("quorum_experiment")
    return 0


if __name__ == "__main__":
    sys.exit(main())
