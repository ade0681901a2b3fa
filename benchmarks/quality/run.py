"""Run the quality suite's experiments and render docs/quality.md (issue 20).

    python benchmarks/quality/run.py                      # all, seeds 0 1 2, render the docs
    python benchmarks/quality/run.py scaling outer        # some experiments
    python benchmarks/quality/run.py --fast --out /tmp/q  # the fast setting (the test's)
    python benchmarks/quality/run.py gpu_profile --profile gpu --time-limit 540  # one GPU

First the inner lr sweep (``tuning.py``, written to ``lr_sweep.json``) and, when ``async`` is
to run, its outer lr sweep (written beside it), then the experiments, every configuration at the
lr chosen for its kind. Writes one JSON file per experiment to ``--out`` (default
``benchmarks/results/quality``), with a row per configuration and seed. An experiment with its
own scale (the one-GPU profile, ``gpu.py``) is not swept: its rows train at the profile's lr.
Pretrained checkpoints and finished rows are cached under ``--out``/cache, so an interrupted run
picks up where it stopped (``--no-cache`` recomputes).
The docs are rendered when the default CPU suite ran (or with ``--render DIR``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the root, for benchmarks

from benchmarks.quality.experiments import DEFAULT, FAST, Experiment, Scale, async_lr  # noqa: E402
from benchmarks.quality.protocol import FAST as FAST_PROFILE  # noqa: E402
from benchmarks.quality.protocol import PROFILES, Profile  # noqa: E402
from benchmarks.quality.rows import run_config  # noqa: E402
from benchmarks.quality.suite import APART, EXPERIMENTS  # noqa: E402
from benchmarks.quality.tuning import (  # noqa: E402
    chosen_lrs,
    run_outer_sweep,
    run_sweep,
    sweep_configs,
    with_lr,
    with_outer_lr,
)

ROOT = Path(__file__).resolve().parents[2]


def host() -> dict[str, Any]:
    """The machine and its load now (what the page's suite time was measured on)."""
    cpu = platform.machine()  # not platform.processor(): on Linux that starts `uname -p`
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        names = [
            ln.split(":", 1)[1].strip()
            for ln in cpuinfo.read_text().splitlines()
            if ln.startswith("model name")
        ]
        cpu = names[0] if names else cpu
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "load": os.getloadavg()[0],
        "utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
    }


def setting(args: argparse.Namespace, exp: Experiment | None = None) -> tuple[Profile, Scale]:
    """The profile and scale the arguments ask for (``--fast``: the toy profile of ``cpu``), at
    ``exp``'s own scale where it has one."""
    scale = FAST if args.fast else (exp and exp.scale) or DEFAULT
    profile = FAST_PROFILE if args.fast and args.profile == "cpu" else PROFILES[args.profile]
    if args.device:
        profile = replace(profile, device=args.device)
    return profile, scale


def run_experiment(
    name: str, args: argparse.Namespace, lrs: dict[str, float], outer_lr: float | None = None
) -> dict[str, Any]:
    """Every configuration of experiment ``name`` for every seed, each at the chosen lr of its
    kind (``lrs``) and, async Delayed Nesterov rows, the outer sweep's ``outer_lr``; the results
    file's content."""
    exp = EXPERIMENTS[name]
    profile, scale = setting(args, exp)
    cache = Path(args.out) / "cache"
    t0, start = time.monotonic(), host()
    rows, skipped = [], []
    for seed in args.seeds:
        for config in exp.configs(scale):
            if args.deadline and time.monotonic() > args.deadline:
                skipped.append(f"{config.name} (seed {seed})")
                continue
            if outer_lr is not None:
                config = with_outer_lr(config, outer_lr)
            config = config if exp.scale else with_lr(config, lrs)
            row = run_config(config, profile, seed, scale, cache, args.deadline)
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
        "inner_lr": {} if exp.scale else lrs,
        **({"outer_lr": outer_lr} if outer_lr is not None else {}),
        "host": {"start": start, "end": host()},
        "elapsed_s": time.monotonic() - t0,  # this invocation's (cached rows cost ~0)
        "rows": rows,
        "skipped": skipped,
    }


def slept(config: Any, n: int, step_s: float) -> float:
    """The wall time of ``n`` inner steps of a row whose workers sleep ``config.delays`` after
    each step of ``step_s`` compute: behind a barrier every worker takes its share at the
    slowest one's pace; otherwise (a quorum, a shared budget) each goes at its own pace."""
    paces = [d + step_s for d in config.delays]
    if config.server.get("quorum"):
        return n / sum(1 / p for p in paces)
    return n / len(paces) * max(paces)


def plan(scale: Scale, step_s: float, batch: int, cores: int = 2) -> list[tuple[str, int, float]]:
    """What the default command would cost, before running it: the pretrains, then per
    experiment (and the lr sweep) the inner steps of its distinct rows over all workers and
    seeds, and the projected seconds at ``step_s`` per step of ``batch`` sequences, rows of M
    workers sharing ``cores``, a row already counted by an earlier experiment counting 0 (the
    cache). Each row's evaluations (its curve points and the final model, on one core after the
    run) count as ``scale.windows`` sequences forward each, a third of a step's compute per
    sequence; the server's own work is left out."""
    seen: set[str] = set()
    eval_steps = scale.windows / (3 * batch)
    pretrain = scale.pretrain_steps * len(scale.seeds)
    out = [("pretrain", pretrain, pretrain * step_s)]

    def cost(configs: list[Any], seeds: Any) -> tuple[int, float]:
        steps, wall = 0, 0.0
        for config in configs:
            for seed in seeds:
                key = json.dumps([asdict(replace(config, name="")), seed], sort_keys=True)
                if key in seen:
                    continue
                seen.add(key)
                if config.kind == "diloco":
                    n = config.steps if config.shared_budget else config.steps * config.workers
                    if "until" in config.clock:  # a time budget: each worker's steps in it
                        assert config.delays is not None
                        until = config.clock["until"]  # (+1e-9: a step ending on it counts)
                        n = min(n, sum(int(until / d + 1e-9) for d in config.delays))
                    threads = config.workers
                    points = n // config.workers // config.sync_every
                    if config.shared_budget:  # async: a curve point per upload
                        points = n // config.sync_every
                    points *= int(config.worker.get("num_fragments", 1))
                else:
                    n, threads = config.steps * config.replicas, 1
                    points = config.steps // config.sync_every
                if scale.curve_points:
                    points = min(points, scale.curve_points)
                steps += n
                size = (config.batch_size or batch) / batch  # Muon rows: a share of the batch
                compute = n * step_s * size / min(threads, cores)
                if config.delays and not config.clock:  # real sleeps (claim q)
                    compute = slept(config, n, step_s * threads / min(threads, cores))
                wall += compute + (points + 1) * eval_steps * step_s
        return steps, wall

    sweep = [replace(c, lr=lr) for c in sweep_configs(scale).values() for lr in scale.lrs]
    out.append(("lr sweep", *cost(sweep, [0])))
    if EXPERIMENTS["async"].default:
        out.append(("async outer sweep", *cost(async_lr(scale), [0])))
    for name, exp in EXPERIMENTS.items():
        if exp.default and name not in APART:
            out.append((name, *cost(exp.configs(scale), scale.seeds)))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("names", nargs="*", metavar="NAME", help=f"of {', '.join(EXPERIMENTS)}")
    p.add_argument("--fast", action="store_true", help="the fast setting (the test's)")
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="default the scale's")
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
    p.add_argument(
        "--plan",
        type=float,
        metavar="STEP_MS",
        help="print the suite's projected time at STEP_MS per inner step (one core) and exit",
    )
    args = p.parse_args(argv)
    if args.plan is not None:
        profile, scale = setting(args)
        lines = plan(scale, args.plan / 1000, profile.batch_size)
        for name, steps, wall in lines:
            print(f"{name:<18} {steps:>8} inner steps  {wall / 60:6.1f} min")
        print(
            f"{'total':<18} {sum(s for _, s, _ in lines):>8} inner steps  "
            f"{sum(w for *_, w in lines) / 60:6.1f} min"
        )
        return 0
    unknown = [n for n in args.names if n not in EXPERIMENTS]
    if unknown:
        p.error(f"unknown experiment(s) {', '.join(unknown)}; known: {', '.join(EXPERIMENTS)}")
    if args.time_limit < 0:
        p.error(f"--time-limit must be >= 0, got {args.time_limit}")
    if args.seeds is None:
        args.seeds = list(setting(args)[1].seeds)
    logging.basicConfig(level=logging.WARNING)  # the workers' per-round INFO lines stay quiet
    out = Path(args.out)
    if args.no_cache:
        shutil.rmtree(out / "cache", ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    args.deadline = t0 + args.time_limit if args.time_limit else 0.0
    # The default command runs the experiments that decide verdicts; --fast runs them all but
    # those apart from the CPU suite (the one-GPU profile), which run only when named.
    default = [n for n, e in EXPERIMENTS.items() if (e.default or args.fast) and n not in APART]
    names = args.names or default
    lrs: dict[str, float] = {}
    outer_lr = None
    if any(EXPERIMENTS[n].scale is None for n in names):  # the sweep is the CPU suite's
        profile, scale = setting(args)
        log = lambda line: print(line, flush=True)  # noqa: E731
        sweep = run_sweep(profile, scale, out / "cache", log=log)
        lrs = chosen_lrs(sweep)
        # The async DN rows' outer lr, chosen like the inner ones: when async runs, and when the
        # file being rewritten has it (a later run of other experiments keeps it: cached rows).
        sweep_file = out / "lr_sweep.json"
        had_outer = sweep_file.exists() and "async_outer" in json.loads(sweep_file.read_text())
        if "async" in names or had_outer:
            outer = run_outer_sweep(profile, scale, out / "cache", lrs, log)
            sweep["async_outer"], outer_lr = outer, outer["lr"]
            sweep["run_s"] += outer["run_s"]  # the page's suite time counts both sweeps
        sweep_file.write_text(json.dumps({**sweep, "fast": args.fast}, indent=1))
    for name in names:
        result = run_experiment(name, args, lrs, outer_lr)
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
