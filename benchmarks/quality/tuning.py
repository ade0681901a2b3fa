"""The inner lr sweep (issue 32): every configuration trains at an inner lr chosen for its kind by
one small sweep on the validation split, so no baseline loses for want of a larger lr (the
137k-parameter suite ran everything at 3e-3, and one-worker AdamW at 1e-2 closed most of the gap
that claims e and m were judged on).

Not run on its own (``run.py`` runs it before the experiments). For each kind in ``KINDS`` one
configuration is trained at every lr of ``Scale.lrs`` for ``Scale.tune_steps`` inner steps per
worker, seed 0, from the same pretrained start, and its final loss measured on the validation
split (``Config.heldout``: text held out of training and apart from the test split the verdicts
use); the lr with the lowest loss is the kind's. Its rows go through ``run_config``, so they are
cached like every other row.

The async experiment's Delayed Nesterov outer lr is chosen the same way (``run_outer_sweep``):
``experiments.async_lr``'s rows, each kind's inner lr from the sweep above, seed 0, validation
split; ``with_outer_lr`` gives the choice to every async DN row without an outer lr of its own.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks.quality.experiments import Config, Scale, adamw, async_lr, plain
from benchmarks.quality.muon import split_batch
from benchmarks.quality.protocol import Profile
from benchmarks.quality.rows import run_config

# The kinds of configuration that get their own lr, and what each sweeps.
KINDS = {
    "adamw": "one-worker AdamW at equal steps",
    "adamw_tokens": "one-worker AdamW at equal tokens (M times the steps)",
    "dp": "data-parallel at M times the batch",
    "diloco_m1": "DiLoCo M=1",
    "diloco": "DiLoCo at the reference M (every M >= 2 and every variant of it)",
    # Claim p's Muon rows (muon.py) get their own: Muon's update is orthogonalised, so the best lr
    # need not be AdamW's even with its RMS matched, and each inner optimizer is compared at its
    # own best. At their batch (the global batch split over M workers).
    # Claim p's M=1 AdamW row trains at the Muon rows' global batch, four times the profile's:
    # a kind of its own, swept at that batch like Muon's (at M >= 2 the batch per worker is the
    # profile's or less, and DiLoCo's kind serves).
    "adamw_m1_batch": "DiLoCo M=1 at claim p's global batch (AdamW inside)",
    "muon_m1": "DiLoCo M=1 with Muon inside",
    "muon": "DiLoCo at the reference M with Muon inside (every M >= 2)",
}
SWEEP_SEED = 0
EXTEND = 2  # at most this many points tried beyond either end of the grid (run_sweep)


def next_lr(grid: tuple[float, ...], lr: float, lower: bool) -> float:
    """The grid's next point beyond ``lr``: one ratio of the grid's end on that side (its first
    step below, its last step above)."""
    return lr * grid[0] / grid[1] if lower else lr * grid[-1] / grid[-2]


def extend(
    grid: tuple[float, ...], tried: dict[float, float], trial: Callable[[float], float]
) -> None:
    """Where the lowest loss of ``tried`` (lr -> loss, the grid's points) lies at an end of what
    was tried, the best may lie beyond it: try the next point on that side, up to ``EXTEND``
    times, until the best is inside. ``trial`` runs one lr and gives its loss."""
    for _ in range(EXTEND):
        best = min(tried, key=lambda lr: tried[lr])
        if min(tried) < best < max(tried):
            return
        lr = next_lr(grid, best, best == min(tried))
        tried[lr] = trial(lr)


def lr_kind(config: Config) -> str:
    """The kind whose chosen lr ``config`` trains at: baselines by their budget, DiLoCo by M (every
    server or worker variant of DiLoCo takes its M's lr: the variants are what is compared);
    claim p's rows by inner optimizer and M, its M=1 AdamW row at its own batch."""
    if config.kind == "dp":
        return "dp"
    if config.inner == "muon":
        return "muon_m1" if config.workers == 1 else "muon"
    if config.kind == "diloco" and config.workers == 1 and config.batch_size:
        return "adamw_m1_batch"
    if config.kind == "adamw":
        return "adamw_tokens" if config.equal_tokens else "adamw"
    return "diloco_m1" if config.workers == 1 else "diloco"


def sweep_configs(s: Scale) -> dict[str, Config]:
    """One configuration per kind at the sweep's horizon (``s.tune_steps`` per worker; the
    equal-tokens baseline M times that), measured on the validation split."""
    steps = s.tune_steps
    dp = Config(
        "dp", kind="dp", workers=1, sync_every=s.sync_every, steps=steps, replicas=s.workers
    )
    configs = {
        "adamw": adamw(s, steps, "adamw"),
        "adamw_tokens": replace(adamw(s, steps * s.workers, "adamw_tokens"), equal_tokens=True),
        "dp": dp,
        "diloco_m1": plain(s, "diloco_m1", workers=1, steps=steps),
        "diloco": plain(s, "diloco", steps=steps),
        "adamw_m1_batch": claim_p_sweep(s, "adamw_m1_batch", 1, inner="adamw"),
        "muon_m1": claim_p_sweep(s, "muon_m1", 1),
        "muon": claim_p_sweep(s, "muon", s.workers),
    }
    assert configs.keys() == KINDS.keys()
    return {k: replace(c, heldout="valid") for k, c in configs.items()}


def claim_p_sweep(s: Scale, name: str, workers: int, inner: str = "muon") -> Config:
    """A claim p kind's configuration at ``workers``: ``inner`` inside, the claim's global batch
    split over the workers (``muon.split_batch``), ``s.tune_steps`` per worker."""
    batch = split_batch(s, workers)
    return plain(s, name, workers=workers, steps=s.tune_steps, inner=inner, batch_size=batch)


def run_sweep(
    profile: Profile,
    scale: Scale,
    cache_dir: Path,
    log: Callable[[str], None] = lambda line: None,
) -> dict[str, Any]:
    """Every kind at every lr of the grid (cached rows), and beyond an end of it where the kind's
    best lies there (up to ``EXTEND`` points); the result file's content, with the chosen lr of
    each kind and whether it still lies at an end of what was tried (then the page says so)."""
    t0 = time.monotonic()
    kinds: dict[str, Any] = {}
    costs: list[float] = []  # the rows' run_s: the sweep's cost when computed (cached: theirs)
    for kind, config in sweep_configs(scale).items():

        def trial(lr: float, kind: str = kind, config: Config = config) -> float:
            row = run_config(
                replace(config, lr=lr, name=f"{kind} lr {lr:g}"),
                profile,
                SWEEP_SEED,
                scale,
                cache_dir,
            )
            log(
                f"lr sweep  {kind:<13} lr {lr:<8g} valid {row['eval_loss']:.4f}  ({row['run_s']:5.1f} s)"
            )
            costs.append(row["run_s"])
            return float(row["eval_loss"])

        losses = {lr: trial(lr) for lr in scale.lrs}
        extend(scale.lrs, losses, trial)
        chosen = min(losses, key=lambda lr: losses[lr])
        kinds[kind] = {
            "what": KINDS[kind],
            "losses": sorted([lr, loss] for lr, loss in losses.items()),
            "lr": chosen,
            "edge": chosen in (min(losses), max(losses)),
        }
    return {
        "sweep": "inner lr",
        "seed": SWEEP_SEED,
        "grid": list(scale.lrs),
        "steps": scale.tune_steps,
        "kinds": kinds,
        "run_s": sum(costs),
        "elapsed_s": time.monotonic() - t0,
    }


def chosen_lrs(sweep: dict[str, Any]) -> dict[str, float]:
    """Kind -> the lr the sweep chose."""
    return {kind: float(k["lr"]) for kind, k in sweep["kinds"].items()}


def with_lr(config: Config, lrs: dict[str, float]) -> Config:
    """``config`` at the chosen lr of its kind."""
    return replace(config, lr=lrs[lr_kind(config)])


def run_outer_sweep(
    profile: Profile,
    scale: Scale,
    cache_dir: Path,
    lrs: dict[str, float],
    log: Callable[[str], None] = lambda line: None,
) -> dict[str, Any]:
    """Async + DN + DyLU at every outer lr of ``scale.async_lrs`` (at its kind's inner lr from
    ``lrs``), and beyond an end of the list as ``run_sweep`` extends its grid, measured on the
    validation split; the chosen outer lr, as ``run_sweep`` gives its kinds'."""
    base = async_lr(replace(scale, async_lrs=scale.async_lrs[:1]))[0]
    costs: list[float] = []

    def trial(x: float) -> float:
        server = {**base.server, "outer_lr": x}
        config = replace(base, name=f"async + DN + DyLU, outer lr {x:g}", server=server)
        row = run_config(with_lr(config, lrs), profile, SWEEP_SEED, scale, cache_dir)
        costs.append(row["run_s"])
        log(f"outer sweep  async + DN + DyLU  outer lr {x:<5g} valid {row['eval_loss']:.4f}")
        return float(row["eval_loss"])

    losses = {x: trial(x) for x in scale.async_lrs}
    extend(scale.async_lrs, losses, trial)  # beyond an end of the list, as the inner sweep
    chosen = min(losses, key=lambda x: losses[x])
    return {
        "what": "async + DN + DyLU's outer lr (Delayed Nesterov)",
        "losses": sorted([x, loss] for x, loss in losses.items()),
        "lr": chosen,
        "edge": chosen in (min(losses), max(losses)),
        "run_s": sum(costs),
    }


def with_outer_lr(config: Config, outer_lr: float) -> Config:
    """``config`` with the outer sweep's choice when it is an async Delayed Nesterov row with no
    outer lr of its own (the sweep's rows, and naive async, keep theirs)."""
    server = config.server
    if server.get("mode") != "async" or not server.get("delayed_nesterov") or "outer_lr" in server:
        return config
    return replace(config, server={**server, "outer_lr": outer_lr})
