"""One row of the quality suite: a configuration run for one seed, through the real server and
worker threads (``harness.trials.run_trial``, or ``run_allreduce_trial`` in all-reduce mode) or,
for the baselines, a single model with no server (``protocol.run_single``), or read from the
row cache. Not run on its own (``run.py`` and ``tuning.py`` use it).

The cache key is every setting the row depends on (the configuration, its inner lr and held-out
split included, the profile, the seed, the pretrain, warmup and evaluation windows) but not its
name, so the same settings under two names run once.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.harness.allreduce_trials import run_allreduce_trial
from benchmarks.harness.trials import Trial, run_trial
from benchmarks.quality.experiments import Config, Scale
from benchmarks.quality.protocol import Profile, cache_key, pretrained, run_single
from benchmarks.quality.splits import shard_divergences


def run_config(
    config: Config,
    profile: Profile,
    seed: int,
    scale: Scale,
    cache_dir: Path,
    deadline: float = 0.0,
) -> dict[str, Any]:
    """One row: run ``config`` for ``seed`` (or read it from the row cache). A ``deadline``
    (``time.monotonic()``; 0: none) stops its training early: the row says ``stopped_early`` and
    is not cached (it is not the configuration's row)."""
    # The name is left out of the key: the same settings under two names run once. So is an
    # empty clock (every row but the async experiments'), so those rows keep their keys.
    settings = {
        k: v for k, v in asdict(config).items() if k != "name" and not (k == "clock" and not v)
    }
    key = cache_key(
        config=settings,
        profile=asdict(profile),
        seed=seed,
        pretrain=scale.pretrain_steps,
        warmup=scale.warmup,
        windows=scale.windows,
        curve_points=scale.curve_points,
    )
    path = cache_dir / "rows" / f"{key}.json"
    if path.exists():
        return {**json.loads(path.read_text()), "name": config.name}
    t0, cpu0 = time.monotonic(), time.process_time()
    init = pretrained(profile, seed, scale.pretrain_steps, cache_dir)
    lr = profile.lr if config.lr is None else config.lr
    if config.kind == "diloco":
        corpus = profile.corpus(config.workers, config.split, config.heldout)
        trial = Trial(
            config.name,
            seed,
            workers=config.workers,
            sync_every=config.sync_every,
            server=dict(config.server),
            worker=dict(config.worker),
            delays=list(config.delays) if config.delays else None,
            clock=dict(config.clock) if config.clock else None,
            total_steps=config.steps if config.shared_budget else config.steps * config.workers,
            shared_budget=config.shared_budget,
            batch_size=config.batch_size or profile.batch_size,
            seq_len=profile.seq_len,
            lr=lr,
            init=init,
            warmup=scale.warmup,
            cosine=True,
            corpus=corpus,
            model_fn=profile.model,
            device=profile.device,
            curve=True,
            drop_prob=config.drop_prob,
            curve_windows=scale.windows,
            eval_windows=scale.windows,
            curve_points=scale.curve_points,
            inner=config.inner,
            deadline=deadline,
        )
        row = (run_allreduce_trial if config.server.get("allreduce") else run_trial)(trial)
        row["steps_per_worker"] = row["steps"] / config.workers
        row["peak_sync_bytes"] = max(w.get("peak_sync_bytes_up", 0) for w in row["workers"])
        row["shard_divergence"] = shard_divergences(corpus)
    else:
        corpus = profile.corpus(config.replicas, config.split, config.heldout)
        row = run_single(
            config.name,
            profile,
            seed,
            init,
            corpus,
            steps=config.steps,
            warmup=scale.warmup,
            replicas=config.replicas,
            curve_every=config.sync_every,
            windows=scale.windows,
            lr=lr,
            curve_points=scale.curve_points,
            deadline=deadline,
        )
    row["kind"] = config.kind
    row["run_s"] = time.monotonic() - t0  # everything this row cost: pretrain, run, evaluation
    # The same in CPU seconds of the whole process (all threads): on a shared machine, what sizes
    # the suite (run.py --plan) better than the wall time.
    row["cpu_s"] = time.process_time() - cpu0
    row["config"] = asdict(config)
    if row.get("stopped_early"):
        return row
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(row))
    os.replace(tmp, path)
    return row
