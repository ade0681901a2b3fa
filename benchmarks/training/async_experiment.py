"""Heterogeneous workers: sync DiLoCo, naive async, async with Delayed Nesterov, and async with
Delayed Nesterov and DyLU, on the demo model (arXiv 2401.09135, section 4's setting in small).

    python benchmarks/async_experiment.py --seeds 0 1 2 --unit 0.02

Four workers sleep after every step for ``unit`` times 0.58, 0.75, 1.51 and 3.33 seconds (the
paper's ratio), on top of the step's compute. Every configuration gets the same total number of
local steps (``--total-steps``): sync DiLoCo splits them evenly (its workers move in lockstep);
the async ones share them, so faster workers take more. Reported per configuration: eval loss of
the final global model (mean ± standard deviation over seeds), wall-clock time, outer updates,
mean staleness. Results are printed and written as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Any

from experiment_common import Trial, run_trial, summarise, write_results

RATIO = (0.58, 0.75, 1.51, 3.33)


def configurations(args: argparse.Namespace, seed: int) -> list[Trial]:
    delays = [args.unit * r for r in RATIO]
    common: dict[str, Any] = {
        "seed": seed,
        "workers": len(RATIO),
        "sync_every": args.sync_every,
        "delays": delays,
        "total_steps": args.total_steps,
    }
    outer = {"outer_lr": args.outer_lr, "outer_momentum": 0.9}
    return [
        Trial("sync", server=outer, **common),
        Trial("async (naive)", server={"mode": "async", **outer}, shared_budget=True, **common),
        Trial(
            "async + DN",
            server={"mode": "async", "delayed_nesterov": True, **outer},
            shared_budget=True,
            **common,
        ),
        Trial(
            "async + DN + DyLU",
            server={"mode": "async", "delayed_nesterov": True, "dylu": True, **outer},
            worker={"dylu": True},
            shared_budget=True,
            **common,
        ),
    ]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--unit", type=float, default=0.02, help="seconds; delays are unit * ratio")
    p.add_argument("--total-steps", type=int, default=1200)
    p.add_argument("--sync-every", type=int, default=25)
    p.add_argument("--outer-lr", type=float, default=0.7)
    p.add_argument("--only", nargs="*", help="run only configurations with these names")
    p.add_argument("--out", default="benchmarks/results/async_experiment.json")
    args = p.parse_args()
    rows: list[dict[str, Any]] = []
    for seed in args.seeds:
        for trial in configurations(args, seed):
            if args.only and trial.name not in args.only:
                continue
            row = run_trial(trial)
            rows.append(row)
            print(
                f"seed {seed}  {trial.name:<20} eval {row['eval_loss']:.4f}  "
                f"wall {row['wall_s']:6.1f} s  updates {row['updates']:4d}  "
                f"steps/worker {[w['steps'] for w in row['workers']]}  "
                f"mean staleness {row['staleness']['mean']}",
                flush=True,
            )
    print(
        f"\n{'configuration':<20} {'eval loss':>18} {'wall s':>16} {'updates':>8} {'staleness':>9}"
    )
    for name in dict.fromkeys(r["name"] for r in rows):
        group = [r for r in rows if r["name"] == name]
        stale = [r["staleness"]["mean"] for r in group if r["staleness"]["mean"] is not None]
        print(
            f"{name:<20} {summarise(group, 'eval_loss'):>18} {summarise(group, 'wall_s'):>16} "
            f"{statistics.mean(r['updates'] for r in group):8.1f} "
            f"{(statistics.mean(stale) if stale else 0):9.2f}"
        )
    write_results(args.out, args, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
