"""Goodput under faults: the sync barrier, async with Delayed Nesterov, quorum rounds and a
simulated data-parallel baseline meet one chaos schedule on the demo model.

    python -m benchmarks.goodput                          # 4 workers x 300 steps, every row
    python -m benchmarks.goodput --configs barrier data-parallel --json out.json
    python -m benchmarks.goodput --smoke                  # tiny schedule, the barrier row, checked

The schedule (``benchmarks/faults/goodput_schedule.py``, seeded): a worker killed with SIGKILL
and restarted under its id from its last checkpoint, a straggler at 1/4 speed for a fifth of the
run, a worker frozen with SIGSTOP for ``--freeze-s`` seconds (longer than the heartbeat timeout,
so the server evicts it; why SIGSTOP: ``benchmarks/faults/goodput_run.py``), and the server
killed and restarted from its save dir. Each fault fires at a point of training (rounds' worth
of inner steps in the global model, read from ``/status``), so every configuration meets it at
the same place. Every worker slot trains ``--steps`` inner steps (steps a kill lost are trained
again).

Reported per configuration:

* **goodput**: inner steps that reached the global model / inner steps computed. Computed steps
  are counted by the workers (all lives); reached ones from the server's accounting
  (``benchmarks/faults/step_ledger.py``). A step that is neither was lost in a kill (trained
  after the slot's last checkpoint, ``lost in kills``), dropped by its worker (mixed into an
  upload that had counted already, ``dropped``), or is ``other``: computed again after a kill
  from a checkpoint older than the last counted upload, or counted by a server that died
  before its next checkpoint when no later upload made it up;
* **to target s**: wall seconds from the moment every worker had registered until the global
  model's held-out loss is at or below the target: by default the loss of a fault-free barrier
  run (run first, the table's first row) at 80% of its rounds, or ``--target``;
* **final loss**: the held-out loss of the final global model.

The data-parallel row is a model, not a run (``benchmarks/faults/dataparallel_model.py`` has its
rules): it replays the schedule with the step time, worker restart time and server restart time
measured in the rows that ran, so it has no loss. The quorum row needs the server's
``--quorum``/``--grace`` flags; where the server lacks them the row says so and is skipped.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.faults import dataparallel_model
from benchmarks.faults.goodput_run import run
from benchmarks.faults.goodput_schedule import schedule
from benchmarks.harness import smoke
from benchmarks.harness.report import (
    machine_info,
    now,
    print_machine,
    print_table,
    run_head,
    write_json,
)
from benchmarks.harness.source import ROOT


@dataclass(frozen=True)
class Row:
    """A configuration: its name, the server's flags, whether rounds close together (sync) or
    per upload, the server flags it needs."""

    name: str
    server_args: tuple[str, ...]
    sync: bool
    needs: tuple[str, ...] = ()

    def lacking(self, server_help: str) -> list[str]:
        """The flags this row needs that ``diloco server --help`` does not list."""
        listed = set(re.findall(r"--[a-z][a-z0-9-]*", server_help))
        return [flag for flag in self.needs if flag not in listed]


DATA_PARALLEL = "data-parallel"

ROWS = (
    Row("barrier", (), sync=True),
    Row("async-dn", ("--async", "--delayed-nesterov"), sync=False),
    Row("quorum", ("--quorum", "3", "--grace", "auto"), sync=True, needs=("--quorum", "--grace")),
)
"""The configurations run for real; the data-parallel row is simulated from their timings."""

NAMES = [r.name for r in ROWS] + [DATA_PARALLEL]
TARGET_AT = 0.8  # the target: the fault-free barrier's loss at this share of its rounds


def server_flags() -> str:
    """``diloco server --help`` of this checkout, to see which flags it has."""
    got = subprocess.run(
        [sys.executable, "-m", "diloco", "server", "--help"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    return got.stdout


def evaluate(fetched: list[tuple[float, int, int, Any]], target: float | None) -> dict[str, Any]:
    """The held-out loss of the fetched global models: when the first reached ``target`` (each
    evaluated in order until one does) and the final one's."""
    import torch

    from diloco.demo.data import build_corpus
    from diloco.demo.model import build_model
    from diloco.demo.model import evaluate as held_out

    torch.set_num_threads(1)
    tokens = build_corpus(1).eval  # the held-out text is the same for any number of shards
    model = build_model(0)

    def loss(params: dict[str, torch.Tensor]) -> float:
        missing, unexpected = model.load_state_dict(params, strict=False)
        assert not unexpected and all(k == "mask" for k in missing), (missing, unexpected)
        return held_out(model, tokens)

    hit = None
    if target is not None:
        for t, round_, _, params in fetched:
            if loss(params) <= target:
                hit = {"t": round(t, 2), "round": round_}
                break
    return {"to_target": hit, "final_loss": loss(fetched[-1][3])}


def target_of(reference: dict[str, Any]) -> float:
    """The fault-free barrier's held-out loss at ``TARGET_AT`` of its rounds."""
    rounds = reference["rounds"]
    at = math.ceil(TARGET_AT * rounds)
    chosen = next(f for f in reference["fetched"] if f[1] >= at)
    return float(evaluate([chosen], None)["final_loss"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--steps", type=int, default=300, help="inner steps per worker slot")
    p.add_argument("--sync-every", type=int, default=15)
    p.add_argument("--seed", type=int, default=0, help="the model's and the schedule's")
    p.add_argument("--freeze-s", type=float, default=8.0, help="how long the frozen worker stops")
    p.add_argument("--heartbeat-timeout", type=float, default=5.0, help="the server's")
    p.add_argument("--slow", type=float, default=4.0, help="the straggler's slowdown")
    p.add_argument("--configs", nargs="+", choices=NAMES, default=NAMES)
    p.add_argument("--target", type=float, help="held-out loss (default: see the docstring)")
    p.add_argument("--json")
    smoke.add_flag(p)
    args = p.parse_args(argv)
    if args.smoke:  # 4 workers x 40 steps, 8 rounds, one fault a round; the barrier row and
        # a fixed target well below the initial loss (5.7), so that no reference run is needed
        args.steps, args.sync_every, args.freeze_s, args.heartbeat_timeout = 40, 5, 4.0, 3.0
        args.configs, args.target = ["barrier", DATA_PARALLEL], args.target or 4.0
    cfg = {
        "workers": args.workers,
        "steps": args.steps,
        "sync_every": args.sync_every,
        "seed": args.seed,
        "lr": 3e-3,
        "batch_size": 16,
        "seq_len": 64,
        "heartbeat_interval": 1.0,
        "heartbeat_timeout": args.heartbeat_timeout,
        "deadline_s": 900,
    }
    faults = schedule(
        args.steps // args.sync_every,
        args.workers,
        args.sync_every,
        args.seed,
        args.freeze_s,
        args.slow,
    )
    head = run_head("goodput", now(), machine_info())
    print(
        f"goodput under faults: {args.workers} workers x {args.steps} steps, sync every "
        f"{args.sync_every}, seed {args.seed}; {head['date']}"
    )
    print_machine(head["machine"])
    head["load_before"] = os.getloadavg()
    print(f"load average (1, 5, 15 min): {head['load_before']}")
    for f in faults:
        print(f"  {f.describe()}")
    help_text = server_flags()
    results: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    target = args.target
    with tempfile.TemporaryDirectory() as tmp:
        if target is None:
            print("fault-free barrier run, for the target ...", flush=True)
            reference = run("barrier, no faults", [], True, cfg, (), Path(tmp) / "reference")
            target = target_of(reference)
            reference.update(evaluate(reference.pop("fetched"), target))
            results.append(reference)
            print(
                f"target: held-out loss {target:.4f} (the fault-free barrier's at "
                f"{TARGET_AT:.0%} of {reference['rounds']} rounds)",
                flush=True,
            )
        for row in ROWS:
            if row.name not in args.configs:
                continue
            lacking = row.lacking(help_text)
            if lacking:
                skipped[row.name] = f"the server lacks {', '.join(lacking)}"
                continue
            print(f"{row.name} ...", flush=True)
            got = run(row.name, list(row.server_args), row.sync, cfg, faults, Path(tmp) / row.name)
            got.update(evaluate(got.pop("fetched"), target))
            results.append(got)
    simulated = None
    chaos = [r for r in results if r["faults"]]
    if DATA_PARALLEL in args.configs and chaos:
        simulated = simulate(chaos, args, faults)
    head["load_after"] = os.getloadavg()
    print_report(results, simulated, skipped, target)
    print(f"load average after (1, 5, 15 min): {head['load_after']}")
    if args.json:
        write_json(
            args.json,
            {
                **head,
                "args": vars(args),
                "target": target,
                "schedule": [f.describe() for f in faults],
                "rows": results,
                "data_parallel": simulated,
                "skipped": skipped,
            },
        )
    if args.smoke:
        check_smoke(results, simulated)
    return 0


def simulate(
    results: list[dict[str, Any]], args: argparse.Namespace, faults: Any
) -> dict[str, Any]:
    """The data-parallel row, from the runs' timings: the mean step time of the rows that ran,
    and the median restart times of their killed workers and servers."""
    import statistics

    restarts = [
        f["restart_s"]
        for r in results
        for f in r["faults"]
        if "kill" in f["fault"] and "restart_s" in f
    ]
    servers = [
        f["restart_s"]
        for r in results
        for f in r["faults"]
        if "server" in f["fault"] and "restart_s" in f
    ]
    costs = dataparallel_model.Costs(
        step_s=statistics.mean(r["step_s"] for r in results),
        restart_s=statistics.median(restarts) if restarts else 0.0,
        server_restart_s=statistics.median(servers) if servers else 0.0,
        heartbeat_timeout=args.heartbeat_timeout,
        checkpoint_every=args.sync_every,
    )
    out = dataparallel_model.simulate(args.workers, args.steps, args.sync_every, faults, costs)
    return {
        "costs": vars(costs),
        "wall_s": round(out.wall_s, 2),
        "computed": out.computed,
        "reached": out.reached,
        "goodput": out.goodput,
        "rollbacks": out.rollbacks,
        "stall_s": round(out.stall_s, 2),
        "log": out.log,
    }


def print_report(
    results: list[dict[str, Any]], dp: dict[str, Any] | None, skipped: dict[str, str], target: float
) -> None:
    print(f"\ntarget held-out loss: {target:.4f}")
    rows = []
    for r in results:
        other = r["computed"] - r["reached"] - r["lost_in_kills"] - r["dropped"]
        hit = r["to_target"]
        rows.append(
            [
                r["name"],
                f"{r['reached'] / r['computed']:.3f}",
                str(r["computed"]),
                str(r["reached"]),
                str(r["lost_in_kills"]),
                str(r["dropped"]),
                str(other),
                f"{r['wall_s']:.1f}",
                "not reached" if hit is None else f"{hit['t']:.1f}",
                f"{r['final_loss']:.4f}",
            ]
        )
    if dp is not None:
        rows.append(
            [
                f"{DATA_PARALLEL} (model)",
                f"{dp['goodput']:.3f}",
                str(dp["computed"]),
                str(dp["reached"]),
                str(dp["computed"] - dp["reached"]),
                "-",
                "-",
                f"{dp['wall_s']:.1f}",
                "-",
                "-",
            ]
        )
    for name, why in skipped.items():
        rows.append([name, f"not run: {why}", *["-"] * 8])
    print_table(
        [
            "configuration",
            "goodput",
            "computed",
            "reached",
            "lost in kills",
            "dropped",
            "other",
            "wall s",
            "to target s",
            "final loss",
        ],
        rows,
    )
    for r in results:
        for f in r["faults"]:
            extra = {k: v for k, v in f.items() if k != "fault"}
            print(f"  {r['name']}: {f['fault']} {extra}")


def check_smoke(results: list[dict[str, Any]], dp: dict[str, Any] | None) -> None:
    """The barrier row ran with every fault fired; its counts add up; the model and the
    data-parallel row give sane figures."""
    smoke.require(len(results) == 1 and results[0]["name"] == "barrier", "the barrier row ran")
    r = results[0]
    smoke.require(
        not r["not_fired"] and len(r["faults"]) == 5, f"every fault fired ({r['not_fired']})"
    )
    smoke.require(
        not any("skipped" in f for f in r["faults"]), "no fault found its worker finished"
    )
    smoke.require(r["server_restarts"] == 1, "the server was restarted once")
    smoke.require(0 < r["reached"] <= r["computed"], f"reached {r['reached']} of {r['computed']}")
    smoke.require(r["computed"] >= 4 * 40, "every slot trained its budget")
    smoke.require(0 < r["final_loss"] < 10, f"a finite held-out loss ({r['final_loss']})")
    smoke.require(r["to_target"] is not None, "the global model reached the target loss")
    smoke.require(dp is not None and 0 < dp["goodput"] <= 1, "the data-parallel model ran")
    smoke.passed("goodput")


if __name__ == "__main__":
    sys.exit(main())
