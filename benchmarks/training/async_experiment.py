"""Heterogeneous workers: sync DiLoCo, naive async, async with Delayed Nesterov, async with
Delayed Nesterov and DyLU, async with Delayed Nesterov weighted by 1/sqrt(1 + staleness), and
async with Delayed Nesterov behind the age gate (one per ``--cutoffs`` S: uploads more than S
updates old are not applied, CGAD's idea, arXiv 2605.09126), on the demo model (arXiv 2401.09135, section 4's setting in small).

    python -m benchmarks.training.async_experiment --seeds 0 1 2 --unit 0.02
    python -m benchmarks.training.async_experiment --smoke   # sync, async + DN, + age gate

Four workers sleep after every step for ``unit`` times 0.58, 0.75, 1.51 and 3.33 seconds (the
paper's ratio), on top of the step's compute. Every configuration gets the same total number of
local steps (``--total-steps``): sync DiLoCo splits them evenly (its workers move in lockstep);
the async ones share them, so faster workers take more. Reported per configuration: eval loss of
the final global model (mean ± standard deviation over seeds), wall-clock time, outer updates,
mean staleness, uploads the age gate acknowledged without applying. Results are printed and written as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from typing import Any

from benchmarks.harness import smoke
from benchmarks.harness.report import print_table, write_json
from benchmarks.harness.trials import Trial, by_name, run_trials, summarise

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
        Trial(
            "async + DN + inverse_sqrt",
            server={
                "mode": "async",
                "delayed_nesterov": True,
                "staleness_weighting": "inverse_sqrt",
                **outer,
            },
            shared_budget=True,
            **common,
        ),
        *(
            Trial(
                gate_name(cutoff),
                server={
                    "mode": "async",
                    "delayed_nesterov": True,
                    "staleness_weighting": "age_gate",
                    "staleness_cutoff": cutoff,
                    **outer,
                },
                shared_budget=True,
                **common,
            )
            for cutoff in args.cutoffs
        ),
    ]


def gate_name(cutoff: int) -> str:
    return f"async + DN + age gate {cutoff}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--unit", type=float, default=0.02, help="seconds; delays are unit * ratio")
    p.add_argument("--total-steps", type=int, default=1200)
    p.add_argument("--sync-every", type=int, default=25)
    p.add_argument("--outer-lr", type=float, default=0.7)
    p.add_argument(
        "--cutoffs", type=int, nargs="+", default=[8], help="the age gate's --staleness-cutoff"
    )
    p.add_argument("--only", nargs="*", help="run only configurations with these names")
    p.add_argument("--out", default="benchmarks/results/async_experiment.json")
    smoke.add_flag(p)
    args = p.parse_args(argv)
    if args.smoke:  # sync, async + DN and the age gate, 10 steps per worker, 1 ms units
        args.seeds, args.unit, args.total_steps, args.sync_every = [0], 0.001, 40, 5
        args.cutoffs = [2]
        args.only, args.out = ["sync", "async + DN", gate_name(2)], None
    rows: list[dict[str, Any]] = []
    for seed, trial, row in run_trials(configurations, args):
        rows.append(row)
        print(
            f"seed {seed}  {trial.name:<20} eval {row['eval_loss']:.4f}  "
            f"wall {row['wall_s']:6.1f} s  updates {row['updates']:4d}  "
            f"steps/worker {[w['steps'] for w in row['workers']]}  "
            f"mean staleness {row['staleness']['mean']}  gated {row['staleness']['gated']}",
            flush=True,
        )
    table = []
    for name, group in by_name(rows).items():
        stale = [r["staleness"]["mean"] for r in group if r["staleness"]["mean"] is not None]
        table.append(
            [
                name,
                summarise(group, "eval_loss"),
                summarise(group, "wall_s"),
                f"{statistics.mean(r['updates'] for r in group):.1f}",
                f"{(statistics.mean(stale) if stale else 0):.2f}",
                f"{statistics.mean(r['staleness']['gated'] for r in group):.1f}",
            ]
        )
    print()
    print_table(["configuration", "eval loss", "wall s", "updates", "staleness", "gated"], table)
    if args.out:
        write_json(args.out, {"args": vars(args), "rows": rows})
    if args.smoke:
        for r in rows:
            smoke.require(math.isfinite(r["eval_loss"]), f"{r['name']}: a finite loss")
            smoke.require(r["updates"] >= 1, f"{r['name']}: outer updates happened")
            smoke.require(r["steps"] == args.total_steps, f"{r['name']}: the budget was spent")
        smoke.require(len(rows) == 3, "the three configurations ran")
        smoke.passed("async_experiment")
    return 0


if __name__ == "__main__":
    sys.exit(main())
