"""All-reduce runs in-process: the model the all-reduce tests train, and a run of N workers
(threads) against a server in ``--allreduce`` mode, plain or with streaming fragments."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from diloco import DiLoCoWorker
from tests.helpers.threads import in_threads

ROUNDS = 3


EVERY = 6


PERIODS = 3


_SEEDING = threading.Lock()  # torch's global generator: threads must not build models at once

Hook = Callable[[int, int, DiLoCoWorker], None]
"""``hook(rank, step, worker)``."""


def make_model(seed: int = 0) -> torch.nn.Module:
    with _SEEDING:
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(12, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _train(
    address: str,
    n: int,
    steps: int,
    seeds: list[int] | None,
    *,
    bf16: bool,
    samples: Callable[[int], int],
    before_step: Hook | None = None,
    after_step: Hook | None = None,
    per_rank: Callable[[int], dict[str, Any]] | None = None,
    **kw: Any,
) -> list[tuple[dict[str, torch.Tensor], dict[str, float], DiLoCoWorker]]:
    """``n`` workers in threads, ``steps`` seeded SGD steps each (``sync_every=EVERY``), each
    step reporting ``samples(rank)``; per worker its final parameters and metrics (taken before
    it leaves) and the worker itself (left). ``per_rank(rank)``: worker settings of that rank's
    own, beside ``kw``."""

    def run(rank: int) -> tuple[dict[str, torch.Tensor], dict[str, float], DiLoCoWorker]:
        model = make_model(seeds[rank] if seeds else 0)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        gen = torch.Generator().manual_seed(100 + rank)
        with DiLoCoWorker(
            model,
            opt,
            address,
            sync_every=EVERY,
            heartbeat_interval=0.2,
            bf16_comm=bf16,
            worker_id=f"w{rank}",
            **kw,
            **(per_rank(rank) if per_rank is not None else {}),
        ) as w:
            for step in range(steps):
                if before_step is not None:
                    before_step(rank, step, w)
                for p in model.parameters():
                    p.grad = torch.randn(p.shape, generator=gen)
                opt.step()
                w.report(samples=samples(rank))
                if after_step is not None:
                    after_step(rank, step, w)
            params = {k: v.detach().clone() for k, v in model.named_parameters()}
            metrics = dict(w.sync_metrics)
        return params, metrics, w

    return in_threads(n, run)


def run_workers(
    address: str,
    n: int,
    rounds: int,
    after_sync: Hook | None = None,
    seeds: list[int] | None = None,
    bf16: bool = False,
    **kw: Any,
) -> list[tuple[dict[str, torch.Tensor], dict[str, float]]]:
    """``n`` workers in threads, ``rounds`` rounds of ``EVERY`` seeded SGD steps each; returns
    each worker's final parameters and metrics. ``after_sync(rank, round, worker)`` runs after
    each of a worker's syncs."""

    def synced(rank: int, step: int, w: DiLoCoWorker) -> None:
        if after_sync is not None and w.local_step == 0:
            after_sync(rank, (step + 1) // EVERY, w)

    done = _train(
        address, n, rounds * EVERY, seeds, bf16=bf16, samples=lambda _: 1, after_step=synced, **kw
    )
    return [(params, metrics) for params, metrics, _ in done]


def run_streaming(
    address: str,
    n: int,
    seeds: list[int] | None = None,
    tamper: Hook | None = None,
    **kw: Any,
) -> list[dict[str, Any]]:
    """``n`` workers in threads, ``PERIODS * EVERY`` seeded SGD steps each; per worker its final
    parameters (taken before it leaves), metrics, the state it held after each step at which
    no round was in flight (all-reduce mode only), and the keys of its quantized quorums'
    residuals (``QuorumSync.residuals``). ``tamper(rank, step, worker)`` runs before
    each step."""
    states: list[dict[int, list[torch.Tensor]]] = [{} for _ in range(n)]

    def held(w: DiLoCoWorker) -> list[torch.Tensor]:
        strategy: Any = w._strategy
        return [t.clone() for t in [*w._local.snapshot.values(), *strategy._state.momentum]]

    def note(rank: int, step: int, w: DiLoCoWorker) -> None:
        strategy: Any = w._strategy
        if hasattr(strategy, "_state") and strategy._payload._inflight is None:
            states[rank][w.base_round] = held(w)

    done = _train(
        address,
        n,
        PERIODS * EVERY,
        seeds,
        bf16=False,
        samples=lambda rank: rank + 1,  # unequal: samples weighting must use them
        before_step=tamper,
        after_step=note,
        **kw,
    )
    out = []
    for rank, (params, metrics, w) in enumerate(done):
        if hasattr(w._strategy, "_state"):  # after leaving: the round that was in flight ended
            states[rank][w.base_round] = held(w)
        residuals = getattr(w._strategy, "residuals", None)
        keys = [] if residuals is None else list(residuals.held)
        out.append(
            {"params": params, "metrics": metrics, "states": states[rank], "residual_keys": keys}
        )
    return out


def run_faulty(
    address: str,
    n: int,
    rounds: int,
    fault: Hook,
    *,
    samples: Callable[[int], float] = lambda _: 1,
    **kw: Any,
) -> tuple[list[dict[str, Any]], dict[int, dict[int, tuple[str, dict[str, torch.Tensor]]]]]:
    """``n`` workers in threads, ``rounds * EVERY`` seeded SGD steps each, ``fault(rank, step,
    worker)`` before each step (where a test breaks one worker's model). Returns per worker its
    final parameters and metrics, and by rank, by the round of the state held after each sync
    (or merge) with no round in flight: (the hash of the shared state, the model's parameters)."""
    held: dict[int, dict[int, tuple[str, dict[str, torch.Tensor]]]] = {r: {} for r in range(n)}

    def note(rank: int, step: int, w: DiLoCoWorker) -> None:
        strategy: Any = w._strategy
        payload = strategy._payload
        if w.local_step == 0 and getattr(payload, "_inflight", None) is None:
            params = {k: v.detach().clone() for k, v in w._local.params.items()}
            held[rank][w.base_round] = (strategy._state.hash(), params)

    done = _train(
        address,
        n,
        rounds * EVERY,
        None,
        bf16=False,
        samples=samples,
        before_step=fault,
        after_step=note,
        **kw,
    )
    return [{"params": p, "metrics": m} for p, m, _ in done], held
