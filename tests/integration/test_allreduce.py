"""All-reduce mode end to end (issue 19): workers in threads of this process, a real server with
``allreduce=True`` on loopback. Same result as the server mode with fp32 communication, every
worker bit-identical to every other after every round, a joiner that starts from other
parameters takes the run's state before it contributes."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from diloco import DiLoCoServer, DiLoCoWorker, ServerConfig
from diloco.persistence import list_checkpoints, load_checkpoint
from tests.helpers.allreduce import make_model, run_workers

ROUNDS = 4








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
