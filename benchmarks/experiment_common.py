"""Shared harness of the training experiments: an in-process server and worker threads training
the demo model, each with its own shard, optional per-step delays, and a step budget.

Threads, not processes: the simulated step delays (sleeps) dominate each step, torch releases
the GIL in its kernels, and one process keeps the budget counter and the results simple.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from diloco import DiLoCoServer, DiLoCoWorker, ServerConfig
from diloco.demo.data import build_corpus, sample_batch
from diloco.demo.model import build_model, evaluate, loss_on


@dataclass
class Trial:
    name: str
    seed: int
    workers: int = 4
    sync_every: int = 25
    server: dict[str, Any] = field(default_factory=dict)  # extra ServerConfig fields
    worker: dict[str, Any] = field(default_factory=dict)  # extra DiLoCoWorker arguments
    delays: list[float] | None = None  # seconds slept after each step, per worker
    total_steps: int = 1000  # local steps of all workers together
    shared_budget: bool = False  # True: fast workers take more of the steps (async)
    batch_size: int = 16
    seq_len: int = 64
    lr: float = 3e-3


class Budget:
    """Local steps left to the run; ``take`` is called before each step."""

    def __init__(self, total: int) -> None:
        self.left = total
        self._lock = threading.Lock()

    def take(self) -> bool:
        with self._lock:
            if self.left <= 0:
                return False
            self.left -= 1
            return True


def run_trial(trial: Trial) -> dict[str, Any]:
    torch.set_num_threads(1)
    corpus = build_corpus(trial.workers)
    config = ServerConfig(
        port=0,
        num_workers=trial.workers,
        heartbeat_timeout=0,
        stuck_timeout=0,
        **trial.server,
    )
    # The server starts from the model's initial parameters (every worker builds the same ones
    # from the seed), so no worker waits for another to upload them.
    init = {
        n: p.detach().clone() for n, p in build_model(trial.seed, trial.seq_len).named_parameters()
    }
    server = DiLoCoServer(config, initial_params=init).start()
    per_worker = trial.total_steps // trial.workers
    shared = Budget(trial.total_steps)
    results: list[dict[str, Any]] = [{} for _ in range(trial.workers)]
    errors: list[BaseException] = []
    start = threading.Barrier(trial.workers)

    def work(rank: int) -> None:
        try:
            model = build_model(trial.seed, trial.seq_len)
            opt = torch.optim.AdamW(model.parameters(), lr=trial.lr)
            gen = torch.Generator().manual_seed(trial.seed * 1000 + rank)
            delay = trial.delays[rank] if trial.delays else 0.0
            own = Budget(per_worker)
            budget = shared if trial.shared_budget else own
            steps = 0
            worker = DiLoCoWorker(
                model,
                opt,
                server.address,
                sync_every=trial.sync_every,
                worker_id=f"w{rank}",
                heartbeat_interval=0.25,
                **trial.worker,
            )
            start.wait()
            with worker:
                while budget.take():
                    x, y = sample_batch(corpus.shards[rank], trial.batch_size, trial.seq_len, gen)
                    loss = loss_on(model, x, y)
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                    steps += 1
                    if delay:
                        time.sleep(delay)
            results[rank] = {"steps": steps, **worker.sync_metrics}
        except BaseException as exc:  # reported by the caller
            errors.append(exc)
            start.abort()

    t0 = time.monotonic()
    threads = [threading.Thread(target=work, args=(r,)) for r in range(trial.workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    try:
        if errors:
            raise errors[0]
        status = server.status()
        model = build_model(trial.seed, trial.seq_len)
        model.load_state_dict(server.global_params())
        eval_loss = evaluate(model, corpus.eval, trial.seq_len)
    finally:
        server.stop()
    return {
        "name": trial.name,
        "seed": trial.seed,
        "eval_loss": eval_loss,
        "wall_s": wall,
        "updates": status["updates"],
        "staleness": status["staleness"],
        "workers": results,
        "steps": sum(r["steps"] for r in results),
    }


def write_results(path: str, args: Any, rows: list[dict[str, Any]]) -> None:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    print(f"\nwrote {out}")


def summarise(rows: list[dict[str, Any]], key: str) -> str:
    values = [r[key] for r in rows]
    if len(values) == 1:
        return f"{values[0]:.4f}"
    return f"{statistics.mean(values):.4f} ± {statistics.stdev(values):.4f}"
