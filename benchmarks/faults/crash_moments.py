"""Chaos at the moments that matter: kill -9 the server many times at each one, and count.

    .venv/bin/python -m benchmarks.faults.crash_moments --reps 5 \
        --json benchmarks/results/crash_moments.json
    .venv/bin/python -m benchmarks.faults.crash_moments --smoke   # one moment, once

Each run is the scenario of ``tests/helpers/crash_scenario.py``: one worker trains 15 steps (a
sync every 3) against a server with ``--save-every 1 --keep 1``; the server is killed at one moment of the
worker's k-th upload (k cycles through 2, 3, 4; cuts inside an upload or a download move too),
restarted from its save dir, and the worker finishes. The ledger (constant gradients, outer SGD
with lr 1) says exactly how many steps reached the global parameters. Per moment it prints the
kills that hit, steps lost without being counted (and the accepted uploads they make up), steps
dropped and counted by the worker, hangs, and restarts that found no checkpoint to load.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from tests.helpers.crash_scenario import MOMENTS, SYNC_EVERY, run

from benchmarks.harness import smoke
from benchmarks.harness.report import print_table, write_json


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5, help="kills per moment (default 5)")
    ap.add_argument("--moments", nargs="+", default=list(MOMENTS), choices=MOMENTS)
    ap.add_argument("--json", metavar="PATH", help="write every run's outcome as JSON")
    smoke.add_flag(ap)
    args = ap.parse_args(argv)
    if args.smoke:  # one kill from inside the server (a crash point), restarted, tallied
        args.reps, args.moments = 1, ["round_folder"]
    outcomes = []
    for moment in args.moments:
        for rep in range(args.reps):
            k = 2 + rep % 3
            cut = 500 + 1500 * (rep % 4)  # bytes into the body before the cut
            with tempfile.TemporaryDirectory(prefix="crash-") as tmp:
                out = run(Path(tmp), moment, kill_round=k, steps=15, cut=cut)
            outcomes.append(out)
            print(
                f"{moment:16s} k={k} cut={cut:5d}: killed={out.killed} hung={out.hung} "
                f"resumed={out.resumed} dropped={out.dropped} missing={out.missing:+.3f} "
                f"exact={out.exact} in_sync={out.in_sync} {out.seconds:.1f}s"
                + (f" errors={out.errors}" if out.errors else ""),
                flush=True,
            )
    print()
    rows = []
    for moment in args.moments:
        mine = [o for o in outcomes if o.moment == moment]
        lost = sum(o.missing for o in mine if o.killed and o.missing == o.missing)
        rows.append(
            [
                moment,
                f"{sum(o.killed for o in mine)}/{len(mine)}",
                f"{lost:.0f} ({lost / SYNC_EVERY:.0f})",
                str(sum(o.dropped for o in mine)),
                str(sum(o.hung or bool(o.errors) for o in mine)),
                str(sum(o.killed and not o.resumed for o in mine)),
                str(sum(o.killed and not (o.exact and o.in_sync) for o in mine)),
                f"{statistics.median(o.seconds for o in mine):.1f}",
            ]
        )
    print_table(
        [
            "moment",
            "kills",
            "steps lost uncounted (accepted uploads)",
            "steps dropped, counted",
            "hangs",
            "restarts without a loadable checkpoint",
            "worker out of step",
            "median s",
        ],
        rows,
    )
    if args.json:
        write_json(args.json, [asdict(o) for o in outcomes])
    bad = [o for o in outcomes if not o.killed or o.hung or o.errors or not o.exact]
    if args.smoke:
        smoke.require(not bad, f"every kill hit, resumed and kept the ledger exact: {bad}")
        smoke.passed("crash_moments")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
