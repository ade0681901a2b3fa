"""Sharded worker groups: FSDP2 / DTensor ranks (gloo, spawned processes) are one DiLoCo worker,
and no rank holds the whole model. Rank-side code is in ``tests/programs/shard_ranks.py``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from diloco import DiLoCoServer, ServerConfig
from tests.helpers import ranks
from tests.helpers.reference import assert_same_params
from tests.programs import group_ranks as gr
from tests.programs import shard_ranks as sr

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]

NAMES = {"0.weight", "0.bias", "2.weight", "2.bias"}


def _assert_shards_are_the_servers(record: dict[str, Any], served: dict[str, torch.Tensor]) -> None:
    for name, (shard, offset) in record["shards"].items():
        box = tuple(slice(o, o + n) for o, n in zip(offset, shard.shape, strict=True))
        assert torch.equal(shard, served[name][box]), (record["round"], name)


def _check_group(tmp_path: Path, g: int, mesh: tuple[int, ...]) -> list[dict[str, Any]]:
    got = [torch.load(tmp_path / f"g{g}r{r}.pt") for r in range(2)]
    served = got[0]["served"]
    assert sorted(served) == list(range(1, ranks.ROUNDS + 1))
    for r, rank in enumerate(got):
        assert [x["outcome"] for x in rank["records"]] == ["adopted"] * ranks.ROUNDS
        for record in rank["records"]:  # after every sync, every rank's shard is the server's
            _assert_shards_are_the_servers(record, served[record["round"]])
        # Each rank's snapshot is its shard, not the model.
        last = rank["records"][-1]["shards"]
        assert rank["facts"]["snapshot"] == {n: tuple(t.shape) for n, (t, _) in last.items()}
        if mesh == (2,):
            assert sum(t.numel() for t, _ in last.values()) < 163 * 0.6, r
    assert got[0]["facts"]["worker_id"] == got[1]["facts"]["worker_id"] is not None
    # Rank 0's staging: no buffer holds more than the largest parameter (16 x 6 fp32).
    assert max(got[0]["facts"]["staging"].values()) <= 16 * 6 * 4
    return got


@pytest.mark.parametrize(
    ("mesh", "comm"),
    [((2,), "fp32"), ((2, 1), "fp32"), ((2,), "bf16")],
    ids=["fsdp", "hsdp", "bf16"],
)
def test_two_fsdp_groups_match_single_process_reference(
    tmp_path: Path, mesh: tuple[int, ...], comm: str
) -> None:
    """Two FSDP2 groups of two ranks (a 1-D mesh, or a 2x1 HSDP mesh: replicated along one
    dim, sharded along the other) equal the DDP groups' reference: workers stepping on the
    mean gradient of their ranks' batches."""
    with DiLoCoServer(ServerConfig(port=0, num_workers=2)) as server:
        groups = [
            ranks.spawn(sr.fsdp_rank, (server.address, g, str(tmp_path), mesh, comm))
            for g in range(2)
        ]
        for ctx in groups:
            ranks.join(ctx, timeout=120)
        status, got = server.status(), server.global_params()
    assert status["round"] == ranks.ROUNDS and status["registrations"] == 2
    for g in range(2):
        _check_group(tmp_path, g, mesh)
    expected = ranks.reference_groups(2)
    assert set(got) == set(expected) == NAMES
    if comm == "fp32":
        assert_same_params(got, expected)
    else:  # bf16 pseudo-gradients: the reference's, rounded once per round
        for name in expected:
            torch.testing.assert_close(got[name], expected[name], atol=2e-2, rtol=2e-2)


def test_fsdp_group_beside_a_plain_worker(tmp_path: Path) -> None:
    """A sharded group and a single-process worker of the same model in one run; the server
    sees the model's own names."""
    with DiLoCoServer(ServerConfig(port=0, num_workers=2)) as server:
        group = ranks.spawn(sr.fsdp_rank, (server.address, 0, str(tmp_path), (2,), "fp32"))
        plain = ranks.spawn(sr.plain_rank, (server.address, 1), nprocs=1)
        ranks.join(group, timeout=120)
        ranks.join(plain, timeout=60)
        status, got = server.status(), server.global_params()
    assert status["round"] == ranks.ROUNDS and status["registrations"] == 2
    _check_group(tmp_path, 0, (2,))
    assert set(got) == NAMES
    assert_same_params(got, ranks.reference_groups(2))


def test_an_fsdp_group_a_ddp_group_and_a_plain_worker_train_in_one_run(tmp_path: Path) -> None:
    """The three kinds of worker of one model in one run: the server sees the model's own
    names from each, and the run equals three single-process workers on their mean gradients."""
    with DiLoCoServer(ServerConfig(port=0, num_workers=3)) as server:
        fsdp = ranks.spawn(sr.fsdp_rank, (server.address, 0, str(tmp_path), (2,), "fp32"))
        ddp = ranks.spawn(gr.ddp_rank, (server.address, 1, str(tmp_path), False))
        plain = ranks.spawn(sr.plain_rank, (server.address, 2), nprocs=1)
        for ctx in (fsdp, ddp, plain):
            ranks.join(ctx, timeout=120)
        status, got = server.status(), server.global_params()
    assert status["round"] == ranks.ROUNDS and status["registrations"] == 3
    _check_group(tmp_path, 0, (2,))
    assert set(got) == NAMES
    assert_same_params(got, ranks.reference_groups(3))


def test_sharded_ranks_that_cannot_form_a_worker_fail_on_every_rank(tmp_path: Path) -> None:
    with DiLoCoServer(ServerConfig(port=0, num_workers=1)) as server:
        ranks.join(ranks.spawn(sr.bad_shard_rank, (server.address, str(tmp_path))), timeout=60)
        assert server.status()["registrations"] == 0  # nothing was sent
    errors = [torch.load(tmp_path / f"bad{r}.pt") for r in range(2)]
    assert set(errors[0]) == set(errors[1]) == {"disagree", "partial", "mesh", "codec", "plain"}
    for case in ("disagree", "partial", "codec", "plain"):
        assert errors[0][case] == errors[1][case], case  # the same error on every rank
    e = errors[0]
    assert (
        "rank 1 has parameter 'weight' with placements ['S1'], rank 0 with ['S0']" in e["disagree"]
    )
    assert "parameter 'weight' has placement Partial" in e["partial"]
    assert "only Shard(d) and Replicate()" in e["partial"]
    for r in range(2):
        assert "device mesh of global ranks [0, 1]" in errors[r]["mesh"]
        assert f"the worker group is global ranks [{r}]" in errors[r]["mesh"]
    # A lossy codec is taken with whole-model syncs (test_sharded_codec.py), not streamed.
    assert "codec 'int8' with streaming fragments (num_fragments=2) is not supported" in e["codec"]
    assert "rank 1 holds parameter 'weight' as a plain tensor, rank 0 as a DTensor" in e["plain"]


def test_faults_on_rank_0_of_a_sharded_group(tmp_path: Path) -> None:
    """Rank 0's scripted faults (an unreachable server, then a 410, a re-join and a rebase):
    every rank sees the same outcomes, the kept and rebased progress moves on every shard, and
    every shard ends as the server's parameters."""
    with DiLoCoServer(ServerConfig(port=0, num_workers=1)) as server:
        args = (server.address, 0, str(tmp_path), (2,), "fp32", True)
        ranks.join(ranks.spawn(sr.fsdp_rank, args), timeout=120)
        got = server.global_params()
    outcomes = ["adopted", "kept_local", "adopted", "rebased", "adopted"]
    for r in range(2):
        records = torch.load(tmp_path / f"g0r{r}.pt")["records"]
        assert [x["outcome"] for x in records] == outcomes, r
        _assert_shards_are_the_servers(records[-1], got)
