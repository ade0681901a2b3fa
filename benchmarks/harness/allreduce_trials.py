"""Training trials in all-reduce mode (issue 19; quantized collectives, issue 30 item 4): the
same worker threads as ``trials.run_trial`` against a server with ``allreduce=True``, which only
hosts the quorums' rendezvous. The workers average their pseudo-gradients among themselves
(gloo groups, one per quorum) and each runs the outer step on its own replica.

So what ``run_trial`` takes from the server comes from the replicas here: every worker loads
the trial's starting parameters itself (the server holds none), rank 0 copies its replica after
every round for the curve, and the final model is rank 0's (the collectives keep every replica
bit-identical, which ``tests/integration/test_allreduce_quantized.py`` checks). Bytes are the
collectives' (``sync_metrics["collective_sent"]``/``["collective_received"]``: what each member
moved to and from the others), not HTTP's.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from benchmarks.harness.trials import Budget, Trial, evaluate_curve, worker_loop
from diloco import DiLoCoServer, DiLoCoWorker, ServerConfig
from diloco.demo.data import build_corpus
from diloco.demo.model import build_model, evaluate


class ReplicaCurve:
    """Rank 0's replica after every round (``local_step`` back at 0 after a step: the step's
    sync ran), with the round count, the bytes rank 0 has sent and the time since ``t0``."""

    def __init__(self, steps: list[int], init: dict[str, torch.Tensor]) -> None:
        self.steps = steps
        self.t0 = time.monotonic()
        self.points: list[dict[str, Any]] = [
            {"updates": 0, "bytes_up": 0, "wall_s": 0.0, "worker_steps": 0, "params": init}
        ]

    def after_step(self, rank: int, worker: DiLoCoWorker, model: torch.nn.Module) -> None:
        if rank != 0 or worker.local_step != 0:
            return
        metrics = worker.sync_metrics
        self.points.append(
            {
                "updates": int(metrics["rounds"]),
                "bytes_up": int(metrics["collective_sent"]),
                "wall_s": time.monotonic() - self.t0,
                "worker_steps": sum(self.steps),
                "params": {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters()},
            }
        )


def run_allreduce_trial(trial: Trial) -> dict[str, Any]:
    """``trial`` in all-reduce mode (``trial.server`` holds ``allreduce=True``): the eval loss of
    rank 0's final replica and the run's metrics, as ``run_trial``'s row. ``bytes_up`` and
    ``bytes_down`` are the collectives' bytes summed over the workers; ``collective`` marks it."""
    torch.set_num_threads(1)
    corpus = trial.corpus or build_corpus(trial.workers)
    model_fn = trial.model_fn or (lambda seed: build_model(seed, trial.seq_len))
    init = trial.init or {n: p.detach().clone() for n, p in model_fn(trial.seed).named_parameters()}
    trial.init = init
    config = ServerConfig(
        port=0, num_workers=trial.workers, heartbeat_timeout=0, stuck_timeout=0, **trial.server
    )
    steps = [0] * trial.workers
    curve = ReplicaCurve(steps, init)
    ctx: dict[str, Any] = {
        "corpus": corpus,
        "model_fn": model_fn,
        "shared": Budget(trial.total_steps),
        "steps": steps,
        "results": [{} for _ in range(trial.workers)],
        "final": [{} for _ in range(trial.workers)],
        "start": threading.Barrier(trial.workers),
        "own_init": True,
        "after_step": curve.after_step if trial.curve else lambda *_: None,
    }
    errors: list[BaseException] = []

    def work(rank: int) -> None:
        try:
            worker_loop(trial, rank, ctx)
        except BaseException as exc:  # reported below
            errors.append(exc)
            ctx["start"].abort()

    with DiLoCoServer(config) as server:
        ctx["address"] = server.address
        curve.t0 = t0 = time.monotonic()
        threads = [threading.Thread(target=work, args=(r,)) for r in range(trial.workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.monotonic() - t0
    if errors:
        raise errors[0]
    final = ctx["final"]
    for other in final[1:]:  # the mode's promise, which the eval of rank 0 alone relies on
        assert all(torch.equal(other[n], t) for n, t in final[0].items()), "replicas differ"
    results = ctx["results"]
    model = model_fn(trial.seed).to(trial.device)
    model.load_state_dict(final[0])
    row = {
        "name": trial.name,
        "seed": trial.seed,
        "eval_loss": evaluate(
            model, corpus.eval.to(trial.device), trial.seq_len, trial.eval_windows
        ),
        "wall_s": wall,
        "updates": int(results[0]["rounds"]),
        "collective": True,
        "bytes_up": sum(int(r["collective_sent"]) for r in results),
        "bytes_down": sum(int(r["collective_received"]) for r in results),
        "workers": results,
        "steps": sum(r["steps"] for r in results),
    }
    if trial.curve:
        row["curve"] = evaluate_curve(trial, curve.points, model, corpus)
    return row
