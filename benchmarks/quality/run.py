"""Run the quality suite's experiments and render docs/quality.md (issue 20).

    python benchmarks/quality/run.py                      # all, seeds 0 1 2, render the docs
    python benchmarks/quality/run.py scaling outer        # some experiments
    python benchmarks/quality/run.py --fast --out /tmp/q  # the fast setting (the test's)
    python benchmarks/quality/run.py gpu_profile --profile gpu --time-limit 540  # one GPU

Writes one JSON file per experiment to ``--out`` (default ``benchmarks/results/quality``), with
a row per configuration and seed. Pretrained checkpoints and finished rows are cached under
``--out``/cache, so an interrupted run picks up where it stopped (``--no-cache`` recomputes).
The docs are rendered when the default CPU suite ran (or with ``--render DIR``).
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the root, for benchmarks

from benchmarks.quality.experiments import DEFAULT, FAST, run_config  # noqa: E402
from benchmarks.quality.protocol import PROFILES  # noqa: E402
from benchmarks.quality.suite import APART, EXPERIMENTS  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def run_experiment(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Every configuration of experiment ``name`` for every seed; the results file's content."""
    exp = EXPERIMENTS[name]
    scale = FAST if args.fast else exp.scale or DEFAULT
    profile = PROFILES[args.profile]
    if args.device:
        profile = replace(profile, device=args.device)
    cache = Path(args.out) / "cache"
    t0 = time.monotonic()
    rows, skipped = [], []
    deadline = args.deadline
    for seed in args.seeds:
        for config in exp.configs(scale):
            if deadline and time.monotonic() > deadline:
                skipped.append(f"{config.name} (seed {seed})")
                continue
            row = run_config(config, profile, seed, scale, cache, deadline)
            rows.append(row)
            print(
                f"{name:<14} seed {seed}  {config.name:<48} eval {row['eval_loss']:.4f}  "
                f"({row['run_s']:5.1f} s)",
                flush=True,
            )
    command = "python benchmarks/quality/run.py " + name + (" --fast" if args.fast else "")
    if args.profile != "cpu":
        command += f" --profile {args.profile}"
    if args.time_limit:
        command += f" --time-limit {args.time_limit:g}"
    return {
        "experiment": name,
        "claims": exp.claims,
        "what": exp.what,
        "doc": (exp.configs.__doc__ or "").strip(),
        "fast": args.fast,
        "profile": asdict(profile),
        "scale": asdict(scale),
        "seeds": args.seeds,
        "command": command,
        "elapsed_s": time.monotonic() - t0,  # this invocation's (cached rows cost ~0)
        "rows": rows,
        "skipped": skipped,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("names", nargs="*", metavar="NAME", help=f"of {', '.join(EXPERIMENTS)}")
    p.add_argument("--fast", action="store_true", help="the fast setting (the test's)")
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="default 0 1 2 (fast: 0)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "quality"))
    p.add_argument("--profile", choices=sorted(PROFILES), default="cpu")
    p.add_argument("--device", help="override the profile's device (cpu, cuda)")
    p.add_argument("--no-cache", action="store_true", help="recompute cached rows and pretrains")
    p.add_argument("--render", metavar="DIR", help="render quality.md and plots into DIR")
    p.add_argument(
        "--time-limit",
        type=float,
        default=0.0,
        metavar="S",
        help="stop training S seconds after the start (at the next sync), skip rows not begun",
    )
    args = p.parse_args(argv)
    unknown = [n for n in args.names if n not in EXPERIMENTS]
    if unknown:
        p.error(f"unknown experiment(s) {', '.join(unknown)}; known: {', '.join(EXPERIMENTS)}")
    if args.time_limit < 0:
        p.error(f"--time-limit must be >= 0, got {args.time_limit}")
    if args.seeds is None:
        args.seeds = [0] if args.fast else [0, 1, 2]
    logging.basicConfig(level=logging.WARNING)  # the workers' per-round INFO lines stay quiet
    out = Path(args.out)
    if args.no_cache:
        shutil.rmtree(out / "cache", ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    args.deadline = t0 + args.time_limit if args.time_limit else 0.0
    for name in args.names or [n for n in EXPERIMENTS if n not in APART]:
        result = run_experiment(name, args)
        (out / f"{name}.json").write_text(json.dumps(result, indent=1))
    print(f"suite done in {time.monotonic() - t0:.0f} s; results in {out}", flush=True)
    render_dir = args.render
    if render_dir is None and not args.fast and args.profile == "cpu" and not args.names:
        render_dir = str(ROOT / "docs")
    if render_dir:
        from benchmarks.quality.render import render

        render(out, Path(render_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
