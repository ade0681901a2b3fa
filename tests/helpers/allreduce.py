"""All-reduce runs in-process: the model the all-reduce tests train, and a run of N workers
(threads) against a server in ``--allreduce`` mode, plain or with streaming fragments."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from diloco import DiLoCoWorker

EVERY = 3


_SEEDING = threading.Lock()  # torch's global generator: threads must not build models at once


def make_model(seed: int = 0) -> torch.nn.Module:
    with _SEEDING:
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(12, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def run_workers(
    address: str,
    n: int,
    rounds: int,
    after_sync: Callable[[int, int, DiLoCoWorker], None] | None = None,
    seeds: list[int] | None = None,
    bf16: bool = False,
    **kw: Any,
) -> list[tuple[dict[str, torch.Tensor], dict[str, float]]]:
    """``n`` workers in threads, ``rounds`` rounds of ``EVERY`` seeded SGD steps each; returns
    each worker's final parameters and metrics. ``after_sync(rank, round, worker)`` runs after
    each of a worker's syncs."""
    results: list[Any] = [None] * n
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
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
            ) as w:
                for step in range(rounds * EVERY):
                    for p in model.parameters():
                        p.grad = torch.randn(p.shape, generator=gen)
                    opt.step()
                    w.report(samples=1)
                    if after_sync is not None and w.local_step == 0:
                        after_sync(rank, (step + 1) // EVERY, w)
                results[rank] = (
                    {k: v.detach().clone() for k, v in model.named_parameters()},
                    dict(w.sync_metrics),
                )
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(100)
    assert not errors, errors
    assert all(r is not None for r in results)
    return results


ROUNDS = 3


EVERY = 6


PERIODS = 3


def run_streaming(
    address: str,
    n: int,
    seeds: list[int] | None = None,
    tamper: Callable[[int, int, DiLoCoWorker], None] | None = None,
    **kw: Any,
) -> list[dict[str, Any]]:
    """``n`` workers in threads, ``PERIODS * EVERY`` seeded SGD steps each; per worker its final
    parameters (taken before it leaves), metrics, and the state it held after each step at which
    no round was in flight (all-reduce mode only). ``tamper(rank, step, worker)`` runs after
    each step."""
    out: list[Any] = [None] * n
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            model = make_model(seeds[rank] if seeds else 0)
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            gen = torch.Generator().manual_seed(100 + rank)
            states: dict[int, list[torch.Tensor]] = {}
            with DiLoCoWorker(
                model,
                opt,
                address,
                sync_every=EVERY,
                heartbeat_interval=0.2,
                bf16_comm=False,
                worker_id=f"w{rank}",
                **kw,
            ) as w:
                for step in range(PERIODS * EVERY):
                    if tamper is not None:
                        tamper(rank, step, w)
                    for p in model.parameters():
                        p.grad = torch.randn(p.shape, generator=gen)
                    opt.step()
                    w.report(samples=rank + 1)  # unequal: samples weighting must use them
                    strategy: Any = w._strategy
                    if hasattr(strategy, "_state") and strategy._payload._inflight is None:
                        states[w.base_round] = [
                            t.clone()
                            for t in [*w._local.snapshot.values(), *strategy._state.momentum]
                        ]
                params = {k: v.detach().clone() for k, v in model.named_parameters()}
                metrics = dict(w.sync_metrics)
            # After leaving: the round that was in flight has ended.
            if hasattr(strategy, "_state"):
                states[w.base_round] = [
                    t.clone() for t in [*w._local.snapshot.values(), *strategy._state.momentum]
                ]
            out[rank] = {"params": params, "metrics": metrics, "states": states}
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(100)
    assert not errors, errors
    assert all(r is not None for r in out)
    return out
