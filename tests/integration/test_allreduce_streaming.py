"""Streaming DiLoCo in all-reduce mode (issue 19, ``worker/allreduce_streaming.py``): workers in
threads of this process, a real server with ``allreduce=True`` on loopback. Round ``r`` averages
fragment ``r mod P``; with fp32 communication the workers end where the server mode's streaming
workers end, and every worker holds the same state (snapshot and outer momentum) after every
round."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from diloco import DiLoCoServer, DiLoCoWorker, ServerConfig
from diloco.persistence import list_checkpoints, load_checkpoint
from tests.helpers.allreduce import EVERY, PERIODS, make_model, run_streaming

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
        # weightless round moves nothing; the last round may be averaged but not yet counted).
        fragment = 4 * sum(p.numel() for p in make_model().parameters()) / fragments
        averages = m["rounds"]
        assert averages * (fragment - 4) <= m["collective_bytes"]
        assert m["collective_bytes"] <= (averages + 1) * (fragment + 4)
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
