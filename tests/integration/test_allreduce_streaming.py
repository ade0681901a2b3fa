"""Streaming DiLoCo in all-reduce mode (issue 19, ``worker/allreduce/fragment_rounds.py``): workers
in threads of this process, a real server with ``allreduce=True`` on loopback. Round ``r`` averages
fragment ``r mod P``; with fp32 communication the workers end where the server mode's streaming
workers end, and every worker holds the same state (snapshot and outer momentum) after every
round."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from diloco import DiLoCoServer, DiLoCoWorker, ServerConfig
from diloco.persistence import list_checkpoints, load_checkpoint
from tests.integration.test_allreduce import make_model

EVERY = 6
PERIODS = 3
ROOT = Path(__file__).resolve().parents[2]


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


STREAMING = [
    pytest.param({"num_fragments": 3, "overlap_steps": 0}, "equal", id="P3-sequential-tau0"),
    pytest.param(
        {"num_fragments": 2, "fragment_pattern": "strided", "overlap_steps": 1, "merge_alpha": 0.5},
        "samples",
        id="P2-strided-tau1-alpha0.5-samples",
    ),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("streaming", "weighting"), STREAMING)
def test_streaming_allreduce_ends_where_the_server_modes_streaming_ends(
    streaming: dict[str, Any], weighting: str
) -> None:
    n = 3
    init = {k: v.detach().clone() for k, v in make_model().named_parameters()}
    config = ServerConfig(port=0, num_workers=n, weighting=weighting)
    with DiLoCoServer(config, initial_params=init) as srv:
        server_mode = run_streaming(srv.address, n, **streaming)
    config = ServerConfig(port=0, num_workers=n, allreduce=True, weighting=weighting)
    with DiLoCoServer(config) as srv:
        allreduce = run_streaming(srv.address, n, **streaming)
        status = srv.status()
    fragments = streaming["num_fragments"]
    rounds = PERIODS * fragments
    for ours, theirs in zip(allreduce, server_mode, strict=True):
        torch.testing.assert_close(ours["params"], theirs["params"])
        m = ours["metrics"]
        # The last round may still be out when the loop ends (overlap): merged at leaving.
        assert m["rounds"] >= rounds - (streaming["overlap_steps"] > 0)
        assert m["failed_syncs"] == 0 and m["discarded_rounds"] == 0
        # One fragment's payload per average, fp32: a third or half of the model (the join's
        # weightless round averages one too).
        fragment = 4 * sum(p.numel() for p in make_model().parameters()) / fragments
        averages = m["rounds"] + 1
        assert averages * (fragment - 4) <= m["collective_bytes"] <= averages * (fragment + 4)
    # Every worker held the same state after every round.
    common = set.intersection(*(set(r["states"]) for r in allreduce))
    assert len(common) >= rounds - 1
    for r in common:
        first = allreduce[0]["states"][r]
        for other in allreduce[1:]:
            for a, b in zip(first, other["states"][r], strict=True):
                assert torch.equal(a, b), r
    assert status["rounds_completed"] >= rounds - 1


@pytest.mark.timeout(120)
def test_a_streaming_joiner_with_other_parameters_takes_the_runs_state() -> None:
    with DiLoCoServer(ServerConfig(port=0, num_workers=3, allreduce=True)) as srv:
        results = run_streaming(
            srv.address, 3, seeds=[0, 0, 7], num_fragments=2, overlap_steps=1, merge_alpha=0.5
        )
    assert results[2]["metrics"]["rebases"] == 1
    last = max(results[0]["states"])
    for other in results[1:]:
        for a, b in zip(results[0]["states"][last], other["states"][last], strict=True):
            assert torch.equal(a, b)


@pytest.mark.timeout(120)
def test_a_worker_whose_state_went_wrong_is_resynced_while_its_round_overlaps_training() -> None:
    """Worker 2's snapshot is changed by one element mid-run: its next round's state differs
    from the others', the server's hash comparison finds it, and a later quorum sends it the
    state while its training loop is parked (overlap 2). Every worker ends with the same
    state and no round is lost."""

    def tamper(rank: int, step: int, w: DiLoCoWorker) -> None:
        if rank == 2 and step == EVERY + 1:
            first = next(iter(w._local.snapshot.values()))
            first.view(-1)[0] += 1.0

    with DiLoCoServer(ServerConfig(port=0, num_workers=3, allreduce=True)) as srv:
        results = run_streaming(
            srv.address, 3, tamper=tamper, num_fragments=3, overlap_steps=2, merge_alpha=0.5
        )
    assert results[2]["metrics"]["rebases"] >= 1
    assert results[0]["metrics"]["rebases"] == 0
    last = max(set.intersection(*(set(r["states"]) for r in results)))
    assert last >= PERIODS * 3 - 2
    for other in results[1:]:
        for a, b in zip(results[0]["states"][last], other["states"][last], strict=True):
            assert torch.equal(a, b)


@pytest.mark.timeout(120)
def test_a_worker_killed_inside_a_fragments_allreduce_stalls_the_others_one_heartbeat() -> None:
    """Streaming with overlap: the victim (a real process) is killed inside its first weighted
    all-reduce; the survivors' round fails on their round threads while they train on, is
    discarded, and once the victim is evicted the survivors repeat it. They end with the same
    state, having lost no round to the failure."""
    streaming = {"num_fragments": 2, "overlap_steps": 1, "merge_alpha": 0.5}
    config = ServerConfig(
        port=0, num_workers=3, allreduce=True, heartbeat_timeout=2.0, collective_timeout=10.0
    )
    with DiLoCoServer(config) as srv:
        victim = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.allreduce_victim",
                srv.address,
                "w9",
                json.dumps({"sync_every": EVERY, **streaming}),
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        killed = threading.Event()

        def kill_when_inside() -> None:
            assert victim.stdout is not None
            for line in victim.stdout:
                if json.loads(line).get("inside"):
                    victim.send_signal(signal.SIGKILL)
                    killed.set()
                    return

        killer = threading.Thread(target=kill_when_inside)
        killer.start()
        try:
            survivors = run_streaming(srv.address, 2, **streaming)
        finally:
            victim.kill()
            victim.wait(10)
            killer.join(10)
        status = srv.status()
    assert killed.is_set(), "the victim never reached the all-reduce"
    assert status["rounds_discarded"] >= 1
    for r in survivors:
        assert r["metrics"]["discarded_rounds"] >= 1
    last = max(survivors[0]["states"])
    assert last == max(survivors[1]["states"]) and last >= PERIODS * 2 - 2
    for a, b in zip(survivors[0]["states"][last], survivors[1]["states"][last], strict=True):
        assert torch.equal(a, b)


@pytest.mark.timeout(60)
def test_workers_of_another_fragment_count_are_refused_with_a_clear_message() -> None:
    with DiLoCoServer(ServerConfig(port=0, num_workers=1, allreduce=True, num_fragments=2)) as srv:
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        worker = DiLoCoWorker(model, opt, srv.address, sync_every=EVERY, num_fragments=3)
        with pytest.raises(ValueError, match="num_fragments=2"):
            worker.start()
        assert srv.status()["workers"] == []


@pytest.mark.timeout(120)
def test_streaming_rank_0_checkpoints_resume_a_streaming_server(tmp_path: Path) -> None:
    """The checkpoint holds the server mode's streaming layout: a server started on it serves
    the run's state bit for bit, with each fragment at its own round."""
    save = tmp_path / "ckpt"
    config = ServerConfig(port=0, num_workers=2, allreduce=True, save_every=2)
    with DiLoCoServer(config) as srv:
        results = run_streaming(
            srv.address, 2, num_fragments=3, overlap_steps=0, save_dir=str(save)
        )
    folders = list_checkpoints(save)
    last = load_checkpoint(folders[-1])
    assert last.round % 2 == 0 and last.round >= 6
    assert last.extra["fragments"] == [3, "sequential"]
    held = results[0]["states"][last.round]
    names = list(make_model().state_dict())
    with DiLoCoServer(ServerConfig(port=0, num_workers=1, save_dir=str(save))) as srv:
        status = srv.status()
        assert status["round"] == last.round
        served = srv.global_params()
        for name, tensor in zip(names, held, strict=False):
            assert torch.equal(served[name], tensor), name
