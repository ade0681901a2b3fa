"""Stage sync in swarm mode (issue 29, part D): each stage's replicas run DiLoCo among themselves
with the all-reduce mode's quorums, one quorum series per stage, through a real
``diloco server --swarm`` on loopback; every replica a ``DiLoCoWorker`` in a thread of this
process training its own stage module (no pipeline: the sync is the subject)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from diloco import DiLoCoServer, DiLoCoWorker, ServerConfig
from diloco.persistence import list_checkpoints, load_checkpoint
from tests.helpers.http import post_json
from tests.helpers.stage_sync import (
    EVERY,
    make_stage,
    reference_stage,
    register_for,
    train_replica,
)
from tests.helpers.threads import in_threads

FAST = {"poll_timeout": 0.5, "join_timeout": 0.0, "heartbeat_timeout": 0.0}
ROUNDS = {0: 3, 1: 2}
"""Rounds each stage runs: different counts, so the stages' quorums must be independent."""


def swarm_server(**config: Any) -> DiLoCoServer:
    return DiLoCoServer(
        ServerConfig(port=0, swarm=True, stages=2, **{"min_replicas": 2, **FAST, **config})
    )


def params_of(w: DiLoCoWorker) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in w._local.params.items()}


@pytest.mark.timeout(120)
def test_each_stage_syncs_its_replicas_like_plain_diloco_of_that_stage() -> None:
    """Two stages x two replicas: after every round both replicas of a stage hold the same
    bytes, equal to single-process 2-worker DiLoCo of that stage; stage 0 runs 3 rounds while
    stage 1 runs 2, and ``/status`` shows each stage's round."""
    seen: dict[tuple[int, int], list[dict[str, torch.Tensor]]] = {}
    lock = threading.Lock()
    jobs = [(stage, replica) for stage in (0, 1) for replica in (0, 1)]

    with swarm_server() as srv:

        def run(i: int) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
            stage, replica = jobs[i]

            def record(step: int, w: DiLoCoWorker) -> None:
                if w.local_step == 0:
                    with lock:
                        seen.setdefault((stage, (step + 1) // EVERY), []).append(params_of(w))

            steps = ROUNDS[stage] * EVERY
            return train_replica(srv.address, stage, replica, steps, after_step=record)

        results = in_threads(len(jobs), run)
        status = srv.status()
    for stage, rounds in ROUNDS.items():
        expected = reference_stage(stage, 2, rounds)
        for r in range(1, rounds + 1):
            first, second = seen[(stage, r)]
            for k in first:
                assert torch.equal(first[k], second[k]), (stage, r, k)
            torch.testing.assert_close(first, expected[r])
    for (stage, _), (params, metrics) in zip(jobs, results, strict=True):
        assert metrics["rounds"] == ROUNDS[stage] and metrics["failed_syncs"] == 0
        torch.testing.assert_close(params, reference_stage(stage, 2, ROUNDS[stage])[-1])
    shown = {s["stage"]: (s["round"], s["rounds_completed"]) for s in status["swarm"]["stages"]}
    assert shown == {0: (3, 3), 1: (2, 2)}
    # The reference moved the parameters: the comparison is not vacuous.
    moved = reference_stage(1, 2, 2)
    assert not torch.equal(moved[-1]["0.weight"], moved[0]["0.weight"])


@pytest.mark.timeout(120)
def test_a_joiner_receives_its_stages_agreed_state_and_trains_from_it() -> None:
    """Stage 1's two replicas finish round 1; a third replica built from another seed joins:
    its first quorum hands it the stage's agreed state (the hash the quorum checks equal to the
    others'), and it then trains and syncs with them, all three ending bit-identical."""
    joiner_registered = threading.Event()
    round_one = threading.Event()
    held: dict[str, Any] = {}
    agreed: dict[int, tuple[str, dict[str, torch.Tensor]]] = {}
    lock = threading.Lock()

    with swarm_server() as srv:

        def run(i: int) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
            if i == 2:
                return join(srv.address)

            def hold(step: int, w: DiLoCoWorker) -> None:
                if w.local_step == 0:
                    strategy: Any = w._strategy
                    with lock:
                        agreed[w.base_round] = (strategy._state.hash(), params_of(w))
                if i == 0 and step == EVERY - 1:  # round 1 done: wait for the joiner
                    round_one.set()
                    assert joiner_registered.wait(30)

            return train_replica(srv.address, 1, i, 3 * EVERY, after_step=hold)

        def join(address: str) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
            assert round_one.wait(30)
            register_for(address, "s1r2", 1)  # live now: the next quorum waits for it
            joiner_registered.set()
            module = make_stage(1, seed=7)
            other = dict(make_stage(1).named_parameters())
            assert not torch.equal(module.get_parameter("0.weight"), other["0.weight"])
            opt = torch.optim.SGD(module.parameters(), lr=0.05)
            gen = torch.Generator().manual_seed(9)
            with DiLoCoWorker(
                module, opt, address, worker_id="s1r2", sync_every=EVERY, bf16_comm=False
            ) as w:
                strategy: Any = w._strategy
                held["joined"] = (w.base_round, strategy._state.hash(), params_of(w))
                for _ in range(EVERY):
                    for p in module.parameters():
                        p.grad = torch.randn(p.shape, generator=gen)
                    opt.step()
                    w.report(samples=1)
                final = {k: v.detach().clone() for k, v in module.named_parameters()}
                metrics = dict(w.sync_metrics)
            return final, metrics

        results = in_threads(3, run)
    at, hash_, params = held["joined"]
    assert at == 2  # it joined the quorum of the others' round 2
    assert hash_ == agreed[at][0]
    for k, v in agreed[at][1].items():
        assert torch.equal(params[k], v), k
    assert results[2][1]["rebases"] == 1  # it received the state once
    for params_, _ in results[:2]:
        for k in params_:
            assert torch.equal(params_[k], results[2][0][k]), k


@pytest.mark.timeout(120)
def test_each_stages_rank_0_saves_into_its_folder_a_server_resumes_from(tmp_path: Path) -> None:
    """``--save-every 1``: rank 0 of each stage's quorums writes its stage's state in the
    project's layout under ``save_dir/stage-K``; a parameter server started on stage 1's
    folder serves stage 1's parameters bit for bit, at its round."""
    save = tmp_path / "ckpt"
    jobs = [(stage, replica) for stage in (0, 1) for replica in (0, 1)]
    with swarm_server(save_every=1) as srv:
        results = in_threads(
            4,
            lambda i: train_replica(
                srv.address, jobs[i][0], jobs[i][1], ROUNDS[jobs[i][0]] * EVERY, save_dir=str(save)
            ),
        )
    assert sorted(p.name for p in save.iterdir()) == ["stage-0", "stage-1"]
    for stage, rounds in ROUNDS.items():
        folders = list_checkpoints(save / f"stage-{stage}")
        assert [load_checkpoint(f).round for f in folders] == list(range(rounds + 1))[
            -3:
        ]  # 0: the join
    final = results[2][0]  # stage 1, replica 0
    with DiLoCoServer(ServerConfig(port=0, num_workers=1, save_dir=str(save / "stage-1"))) as ps:
        assert ps.status()["round"] == ROUNDS[1]
        served = ps.global_params()
        assert set(served) == set(final)
        for k in final:
            assert torch.equal(served[k], final[k]), k


@pytest.mark.timeout(60)
def test_an_operators_save_is_written_by_each_stages_next_quorum(tmp_path: Path) -> None:
    """``POST /control/save_state`` (202): the next quorum of every stage saves, each into its
    own folder."""
    save = tmp_path / "ckpt"
    with swarm_server(min_replicas=1) as srv:
        resp = post_json(srv, "/control/save_state", {})
        assert resp.status_code == 202, resp.text
        in_threads(2, lambda k: train_replica(srv.address, k, 0, EVERY, save_dir=str(save)))
    for stage in (0, 1):
        folders = list_checkpoints(save / f"stage-{stage}")
        assert [load_checkpoint(f).round for f in folders] == [0]  # the join's quorum


@pytest.mark.timeout(60)
def test_a_worker_whose_module_is_not_its_stages_is_refused_and_changes_nothing() -> None:
    """Stage 1's table is fixed by its first replica's registration; a worker of stage 1
    registering (again) with stage 0's module gets 409 ``params_mismatch`` and changes nothing,
    as does a new peer asking for stage 1 with it, and a ``/swarm/ready`` with that table is
    refused by the same check; a lossy stage-sync codec is 422."""
    with swarm_server() as srv:
        table = [["0.weight", [3, 8]], ["0.bias", [3]]]
        body = {"worker_id": "good", "info": {"stages": [1], "params": table}}
        ok = post_json(srv, "/register", body)
        assert ok.status_code == 200 and ok.json()["params"] == table
        module = make_stage(0)
        register_for(srv.address, "bad", 1)
        before = srv.status()
        with pytest.raises(ValueError, match="Every replica of stage 1 must host the same"):
            DiLoCoWorker(
                module, torch.optim.SGD(module.parameters(), lr=0.1), srv.address,
                worker_id="bad", sync_every=EVERY, bf16_comm=False,
            ).start()  # fmt: skip
        wrong = [["0.weight", [8, 12]], ["0.bias", [8]]]
        refusals = [
            ({"worker_id": "bad", "info": {"params": wrong}}, 409, "params_mismatch"),  # stage 1
            (
                {"worker_id": "new", "info": {"stages": [1], "params": wrong}},
                409,
                "params_mismatch",
            ),
            ({"worker_id": "new", "info": {"codec": {"codec": "int8"}}}, 422, "codec_refused"),
        ]
        for body, status, code in refusals:
            resp = post_json(srv, "/register", body)
            assert resp.status_code == status and resp.json()["error"] == code, resp.text
        ready = {"worker_id": "good", "stage": 1, "params": wrong, "address": "http://h:1"}
        resp = post_json(srv, "/swarm/ready", ready)
        assert resp.status_code == 409 and resp.json()["error"] == "params_mismatch"
        after = srv.status()
    assert after["swarm"] == before["swarm"]  # the same assignments, tables and route table
    assert {w["worker_id"] for w in after["workers"]} == {"good", "bad"}
    assert after["swarm"]["stages"][1]["num_params"] == 3 * 8 + 3
