"""Claim k's lost uploads (benchmarks/harness/trials.py, ``LossyWorker``) as the DiLoCo paper
drops an outer gradient: left out of the round's average, and the worker trains on from its own
parameters, not the round's result. One worker against a real server on 127.0.0.1 port 0."""

from __future__ import annotations

import threading

import pytest
import torch
from benchmarks.harness.trials import Budget, Trial, lr_factor, worker_loop

from diloco import DiLoCoServer, ServerConfig
from diloco.demo.data import build_corpus, sample_batch
from diloco.demo.model import build_model, loss_on


def _run(drop_prob: float) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict]:
    """One worker, H = 2, 6 inner steps: its final local parameters, the server's, the result."""
    trial = Trial("k", 0, workers=1, sync_every=2, total_steps=6, drop_prob=drop_prob, warmup=2)
    corpus = build_corpus(1)
    init = {n: p.detach().clone() for n, p in build_model(0).named_parameters()}
    config = ServerConfig(
        port=0, num_workers=1, heartbeat_timeout=0, stuck_timeout=0, weighting="samples"
    )
    server = DiLoCoServer(config, initial_params=init).start()
    ctx = {
        "corpus": corpus,
        "model_fn": lambda seed: build_model(seed),
        "address": server.address,
        "shared": Budget(6),
        "steps": [0],
        "results": [{}],
        "start": threading.Barrier(1),
        "final": [{}],
    }
    try:
        worker_loop(trial, 0, ctx)
        final_global = server.global_params()
    finally:
        server.stop()
    return ctx["final"][0], final_global, ctx["results"][0]


def _alone() -> dict[str, torch.Tensor]:
    """The same worker's 6 steps with no DiLoCo at all: same batches, same lr schedule."""
    trial = Trial("k", 0, workers=1, total_steps=6, warmup=2)
    model = build_model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=trial.lr)
    gen = torch.Generator().manual_seed(0)
    shard = build_corpus(1).shards[0]
    for step in range(6):
        for group in opt.param_groups:
            group["lr"] = trial.lr * lr_factor(trial, step, step / 6)
        x, y = sample_batch(shard, trial.batch_size, trial.seq_len, gen)
        loss_on(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.timeout(120)
def test_a_worker_whose_uploads_are_all_lost_trains_on_from_its_own_parameters() -> None:
    """Every upload lost: every round's mean is empty, so the global parameters never move,
    while the worker's own parameters are exactly those of training alone for the same steps
    (each round's progress kept, none replaced by the round's result)."""
    local, final_global, result = _run(1.0)
    assert result["lost_uploads"] == 3 and result["steps"] == 6
    start = {n: p.detach() for n, p in build_model(0).named_parameters()}
    for name, alone in _alone().items():
        torch.testing.assert_close(local[name], alone, rtol=0, atol=0)
        torch.testing.assert_close(final_global[name], start[name], rtol=0, atol=0)


@pytest.mark.timeout(120)
def test_a_worker_with_no_upload_lost_adopts_every_round() -> None:
    """The control: nothing lost, the worker ends on the server's parameters."""
    local, final_global, result = _run(0.0)
    assert result.get("lost_uploads", 0) == 0
    assert any(not torch.equal(local[n], p) for n, p in _alone().items())
    for name, p in final_global.items():
        torch.testing.assert_close(local[name], p)
