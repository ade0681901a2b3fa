"""Worker groups: the ranks of a torch.distributed group (gloo, spawned processes) are one DiLoCo
worker. Rank-side code and references are in ``tests/programs/group_ranks.py``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from diloco import DiLoCoServer, ServerConfig
from tests.helpers import ranks
from tests.helpers.reference import assert_same_params
from tests.programs import group_ranks as gr

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def _server(num_workers: int) -> DiLoCoServer:
    server = DiLoCoServer(ServerConfig(port=0, num_workers=num_workers))
    server.start()
    return server


def _two_ddp_groups(
    config: ServerConfig, tmp_path: Path, codec: str | None = None
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Two DDP groups of two ranks (``group_ranks.ddp_rank``, no faults, uploads in ``codec``)
    through a server run with ``config``; its status and parameters once both groups have left
    (none in all-reduce mode)."""
    with DiLoCoServer(config) as server:
        args = (str(tmp_path), False, codec)
        groups = [ranks.spawn(gr.ddp_rank, (server.address, g, *args)) for g in range(2)]
        for ctx in groups:
            ranks.join(ctx, timeout=90)
        return server.status(), ({} if config.allreduce else server.global_params())


def _assert_ranks_identical(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> None:
    assert len(a) == len(b)
    for step, (x, y) in enumerate(zip(a, b, strict=True)):
        for key in ("outcome", "round", "worker_id", "metrics"):
            assert x[key] == y[key], (step, key, x[key], y[key])
        for name in x["params"]:
            assert torch.equal(x["params"][name], y["params"][name]), (step, name)


def test_two_ddp_groups_match_single_process_reference(tmp_path: Path) -> None:
    status, got = _two_ddp_groups(ServerConfig(port=0, num_workers=2), tmp_path)
    assert status["round"] == ranks.ROUNDS
    assert status["registrations"] == 2  # one per group, made by its rank 0
    for g in range(2):
        r0, r1 = (torch.load(tmp_path / f"g{g}r{r}.pt") for r in range(2))
        _assert_ranks_identical(r0, r1)
        syncs = r0[ranks.SYNC_EVERY :: ranks.SYNC_EVERY]
        assert [s["outcome"] for s in syncs] == ["adopted"] * ranks.ROUNDS
        assert r0[0]["outcome"] == "joined" and r0[0]["worker_id"] is not None
    # After the last sync every rank holds the server's parameters, bit for bit.
    for name, value in r0[-1]["params"].items():
        assert torch.equal(value, got[name]), name
    expected = ranks.reference_groups(2)
    assert set(got) == set(expected)
    assert_same_params(got, expected)


def test_pipeline_split_group_matches_unsplit_model(tmp_path: Path) -> None:
    split, unsplit = _server(num_workers=1), _server(num_workers=1)
    try:
        ranks.join(ranks.spawn(gr.pipeline_rank, (split.address, str(tmp_path))), timeout=60)
        gr.train_unsplit(unsplit.address)
        assert split.status()["registrations"] == 1
        got, expected = split.global_params(), unsplit.global_params()
    finally:
        split.stop()
        unsplit.stop()
    assert set(got) == set(expected) == {f"{i}.{k}" for i in (0, 2, 4) for k in ("weight", "bias")}
    assert_same_params(got, expected)
    stages = [torch.load(tmp_path / f"pipe{r}.pt") for r in range(2)]
    assert set(stages[0][-1]["params"]) == {"0.weight", "0.bias"}
    for r, records in enumerate(stages):
        for name, value in records[-1]["params"].items():  # each rank got its own back
            assert torch.equal(value, got[name]), (r, name)
    assert [x["outcome"] for x in stages[0]] == [x["outcome"] for x in stages[1]]


def test_two_ddp_groups_with_topk_uploads_match_the_reference_with_that_codec(
    tmp_path: Path,
) -> None:
    """Sparse top-k uploads from DDP groups: rank 0 encodes the group's one upload per round
    with error feedback, the ranks stay bit-identical after every step (residual norm
    included), every rank ends on the server's parameters, and those equal two single-process
    workers sending ``topk`` with error feedback on their ranks' mean gradient, rank 0's
    residual norm the reference's."""
    codec = "topk:density=0.1,chunk=64,bits=4"
    status, got = _two_ddp_groups(ServerConfig(port=0, num_workers=2), tmp_path, codec)
    residuals: list[dict[str, torch.Tensor]] = []
    expected = ranks.reference_groups(2, codec, residuals)
    assert status["round"] == ranks.ROUNDS and status["registrations"] == 2
    assert status["submissions"] == 2 * ranks.ROUNDS  # one upload per group per round
    for g in range(2):
        r0, r1 = (torch.load(tmp_path / f"g{g}r{r}.pt") for r in range(2))
        _assert_ranks_identical(r0, r1)
        syncs = r0[ranks.SYNC_EVERY :: ranks.SYNC_EVERY]
        assert [s["outcome"] for s in syncs] == ["adopted"] * ranks.ROUNDS
        norm = sum(float(e.square().sum()) for e in residuals[g].values()) ** 0.5
        assert norm > 0 and syncs[-1]["metrics"]["residual_norm"] == pytest.approx(norm, rel=1e-4)
        for name, value in r0[-1]["params"].items():
            assert torch.equal(value, got[name]), (g, name)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("codec", [None, "int8"], ids=["fp32", "int8"])
def test_faults_on_rank_0_leave_every_rank_in_the_same_state(
    tmp_path: Path, codec: str | None
) -> None:
    """Two DDP ranks, rank 0 with scripted faults (an unreachable server, then a 410 and a
    rebase): the ranks stay identical, the verdicts carry rank 0's metrics, and every rank ends
    with the server's parameters. With int8, rank 0 encodes and keeps the residual."""
    codec_arg = () if codec is None else (codec,)
    with DiLoCoServer(ServerConfig(port=0, num_workers=1)) as srv:
        ctx = ranks.spawn(gr.ddp_rank, (srv.address, 0, str(tmp_path), True, *codec_arg))
        ranks.join(ctx, timeout=90)
        got = srv.global_params()
    r0, r1 = (torch.load(tmp_path / f"g0r{r}.pt") for r in range(2))
    _assert_ranks_identical(r0, r1)
    syncs = r0[ranks.SYNC_EVERY :: ranks.SYNC_EVERY]
    # 2nd: unreachable, kept locally; 4th: the server forgot the worker (410), re-join, rebase.
    assert [s["outcome"] for s in syncs] == [
        "adopted",
        "kept_local",
        "adopted",
        "rebased",
        "adopted",
    ]
    assert syncs[-1]["metrics"]["failed_syncs"] == 1 and syncs[-1]["metrics"]["rebases"] == 1
    # A residual exactly where the codec is lossy (fp32 keeps none).
    assert (syncs[-1]["metrics"]["residual_norm"] > 0) == (codec is not None)
    for name, value in r0[-1]["params"].items():
        assert torch.equal(value, got[name]), name


def test_ranks_that_disagree_fail_at_start_naming_rank_and_difference(tmp_path: Path) -> None:
    server = _server(num_workers=1)
    try:
        ranks.join(ranks.spawn(gr.disagreeing_rank, (server.address, str(tmp_path))), timeout=60)
        assert server.status()["registrations"] == 0  # nothing was sent
    finally:
        server.stop()
    errors = [torch.load(tmp_path / f"bad{r}.pt") for r in range(2)]
    assert errors[0] == errors[1]  # every rank raises the same error
    e = errors[0]
    assert "rank 1 has sync_every=5, rank 0 has 4" in e["sync_every"]
    assert "rank 1" in e["shape"] and "'0.weight'" in e["shape"] and "(17, 6)" in e["shape"]
    assert "rank 1 has num_fragments=2, rank 0 has 1" in e["num_fragments"]
    assert "rank 1 and rank 0 both own parameter" in e["partitioned"]


TRAIN_SCRIPT = """
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from diloco import DiLoCoWorker
from tests.helpers import ranks
from tests.helpers.reference import assert_same_params

dist.init_process_group("gloo")
ddp = DistributedDataParallel(ranks.make_model())
opt = ranks.make_inner(ddp.parameters())
with DiLoCoWorker(ddp, opt) as worker:  # every setting from the DILOCO_* variables
    for x, y in ranks.batches(dist.get_rank(), 8):
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()
print("rank", dist.get_rank(), "worker", worker.worker_id, "rounds", worker.sync_metrics["rounds"])
ranks.leave()
"""


def test_diloco_worker_runs_torchrun_as_one_worker(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(TRAIN_SCRIPT)
    server = _server(num_workers=1)
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    try:
        done = subprocess.run(
            [sys.executable, "-m", "diloco", "worker", "--server", server.address]
            + ["--sync-every", "4", "--no-bf16", "--heartbeat-interval", "0", "--"]
            + [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
            + ["--master-addr", "127.0.0.1", "--master-port", str(ranks.free_port()), str(script)],
            env=env,
            cwd=root,
            capture_output=True,
            text=True,
            timeout=90,
        )
        status = server.status()
    finally:
        server.stop()
    assert done.returncode == 0, done.stderr[:3000] + "\n...\n" + done.stderr[-1500:]
    lines = sorted(line for line in done.stdout.splitlines() if line.startswith("rank "))
    assert len(lines) == 2, f"stdout:\n{done.stdout[-2000:]}\nstderr:\n{done.stderr[-4000:]}"
    ids = {line.split()[3] for line in lines}
    assert len(ids) == 1 and "None" not in ids  # the group's id, on every rank
    assert all(line.endswith("rounds 2") for line in lines)
    assert status["registrations"] == 1 and status["round"] == 2


def test_two_ddp_groups_in_allreduce_mode_match_the_server_mode_reference(tmp_path: Path) -> None:
    """All-reduce mode with worker groups: each group's rank 0 takes part in the quorums, its
    ranks share the result as after any sync; every rank of both groups ends on the same
    parameters, those of two groups through a parameter server (the same maths)."""
    status, _ = _two_ddp_groups(ServerConfig(port=0, num_workers=2, allreduce=True), tmp_path)
    assert status["rounds_completed"] == ranks.ROUNDS
    records = {(g, r): torch.load(tmp_path / f"g{g}r{r}.pt") for g in range(2) for r in range(2)}
    for g in range(2):
        _assert_ranks_identical(records[(g, 0)], records[(g, 1)])
        syncs = records[(g, 0)][ranks.SYNC_EVERY :: ranks.SYNC_EVERY]
        assert [s["outcome"] for s in syncs] == ["adopted"] * ranks.ROUNDS
    final = [records[(g, 0)][-1]["params"] for g in range(2)]
    for name in final[0]:
        assert torch.equal(final[0][name], final[1][name]), name
    expected = ranks.reference_groups(2)
    for name in expected:
        torch.testing.assert_close(final[0][name], expected[name])
