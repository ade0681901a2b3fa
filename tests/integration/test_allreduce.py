"""All-reduce mode end to end (issue 19): workers in threads of this process, a real server with
``allreduce=True`` on loopback. Same result as the server mode with fp32 communication, every
worker bit-identical to every other after every round, a joiner that starts from other
parameters takes the run's state before it contributes."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from diloco import DiLoCoServer, DiLoCoWorker, ServerConfig
from diloco.persistence import list_checkpoints, load_checkpoint

EVERY = 3
ROUNDS = 4


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


@pytest.mark.timeout(120)
def test_allreduce_ends_where_the_server_mode_ends_and_replicas_stay_identical() -> None:
    n = 3
    init = {k: v.detach().clone() for k, v in make_model().named_parameters()}
    with DiLoCoServer(ServerConfig(port=0, num_workers=n), initial_params=init) as srv:
        server_mode = run_workers(srv.address, n, ROUNDS)
        reference = srv.global_params()
    # Every worker's parameters after each round, by round: all must be the same bytes.
    seen: dict[int, list[dict[str, torch.Tensor]]] = {}
    lock = threading.Lock()

    def record(rank: int, r: int, w: DiLoCoWorker) -> None:
        with lock:
            seen.setdefault(r, []).append(
                {k: v.detach().clone() for k, v in w._local.params.items()}
            )

    with DiLoCoServer(ServerConfig(port=0, num_workers=n, allreduce=True)) as srv:
        allreduce = run_workers(srv.address, n, ROUNDS, after_sync=record)
        status = srv.status()
    for params, metrics in allreduce:
        torch.testing.assert_close(params, reference)
        assert metrics["rounds"] == ROUNDS and metrics["failed_syncs"] == 0
    for r in range(1, ROUNDS + 1):
        assert len(seen[r]) == n
        for other in seen[r][1:]:
            for k in other:
                assert torch.equal(other[k], seen[r][0][k]), (r, k)
    # The server mode's workers end on the same parameters too (sanity of the comparison).
    torch.testing.assert_close(server_mode[0][0], reference)
    assert status["rounds_completed"] >= ROUNDS
    assert all(m["rebases"] == 0 for _, m in allreduce)  # the same start: nothing to receive


@pytest.mark.timeout(120)
def test_a_worker_that_starts_from_other_parameters_takes_the_runs_state() -> None:
    """Worker 2 builds its model from another seed: its first quorum (the join) hands it the
    state of the others, so every worker ends bit-identical."""
    with DiLoCoServer(ServerConfig(port=0, num_workers=3, allreduce=True)) as srv:
        results = run_workers(srv.address, 3, 2, seeds=[0, 0, 7])
    first = results[0][0]
    for params, _ in results[1:]:
        for k in first:
            assert torch.equal(params[k], first[k]), k
    assert results[2][1]["rebases"] == 1  # it received the state once
    assert results[0][1]["rebases"] == 0


@pytest.mark.timeout(120)
def test_bf16_communication_keeps_replicas_identical_and_close_to_fp32() -> None:
    """Every member sends bf16 (the default): the quorum's all-reduce carries bf16, every
    replica still ends with the same bytes, within bf16's rounding of the fp32 run."""
    seen: dict[int, list[dict[str, torch.Tensor]]] = {}
    lock = threading.Lock()

    def record(rank: int, r: int, w: DiLoCoWorker) -> None:
        with lock:
            seen.setdefault(w.base_round, []).append(
                {k: v.detach().clone() for k, v in w._local.params.items()}
            )

    with DiLoCoServer(ServerConfig(port=0, num_workers=2, allreduce=True)) as srv:
        bf16 = run_workers(srv.address, 2, 3, after_sync=record, bf16=True)
    with DiLoCoServer(ServerConfig(port=0, num_workers=2, allreduce=True)) as srv:
        fp32 = run_workers(srv.address, 2, 3)
    for r, states in seen.items():
        assert len(states) == 2
        for k in states[0]:
            assert torch.equal(states[0][k], states[1][k]), (r, k)
    for k in fp32[0][0]:
        torch.testing.assert_close(bf16[0][0][k], fp32[0][0][k], rtol=0.02, atol=0.02)
        assert not torch.equal(bf16[0][0][k], fp32[0][0][k])


@pytest.mark.timeout(120)
def test_rank_0_saves_checkpoints_a_server_mode_server_resumes_from(tmp_path: Path) -> None:
    """``--save-every 2``: rank 0 of the quorums of rounds 2 and 4 writes the run's state in the
    server mode's layout; a server started on that folder serves those parameters bit for bit,
    at that round, and the checkpoint holds the outer momentum of every parameter."""
    save = tmp_path / "ckpt"
    with DiLoCoServer(ServerConfig(port=0, num_workers=2, allreduce=True, save_every=2)) as srv:
        results = run_workers(srv.address, 2, 4, save_dir=str(save))
    folders = list_checkpoints(save)
    assert [load_checkpoint(f).round for f in folders] == [2, 4]
    final = results[0][0]
    state = load_checkpoint(folders[-1]).optimizer_state["state"]
    assert len(state) == len(final)
    assert all(float(e["momentum_buffer"].abs().sum()) > 0 for e in state.values())
    with DiLoCoServer(ServerConfig(port=0, num_workers=1, save_dir=str(save))) as srv:
        assert srv.status()["round"] == 4
        served = srv.global_params()
        for k in final:
            assert torch.equal(served[k], final[k]), k
