"""Tensor-parallel worker groups: ranks that ``parallelize_module`` a model (alone on a 1-D
mesh, or under FSDP2 on a 2-D ``(dp, tp)`` mesh, where FSDP2's shards of the tensor-parallel
dim are strided) are one DiLoCo worker through the same DTensor path as FSDP2 groups.
Rank-side code is in ``tests/programs/tp_ranks.py``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from diloco import DiLoCoServer, ServerConfig
from tests.helpers import ranks
from tests.helpers.reference import assert_same_params
from tests.programs import shard_allreduce_ranks as sar
from tests.programs import shard_ranks as sr
from tests.programs import tp_ranks as tp

pytestmark = [pytest.mark.slow, pytest.mark.timeout(200)]

NAMES = {"0.weight", "0.bias", "2.weight", "2.bias"}


@pytest.mark.parametrize(
    ("mesh", "placements"),
    [
        ((2,), {"0.weight": ["S(0)"], "2.weight": ["S(1)"], "2.bias": ["R"]}),
        (
            (2, 2),
            {  # FSDP2 over dp on top of tp: dim 0 cut by both is strided
                "0.weight": ["_S(0, 2)", "S(0)"],
                "2.weight": ["S(0)", "S(1)"],
                "2.bias": ["S(0)", "R"],
            },
        ),
    ],
    ids=["tp", "fsdp_tp"],
)
def test_tp_group_beside_a_plain_worker_matches_single_process_reference(
    tmp_path: Path, mesh: tuple[int, ...], placements: dict[str, list[str]]
) -> None:
    """A tensor-parallel group (group 0 of ``reference_groups``: streams 0 and 1 per step) and
    a single-process worker (group 1) end at the reference's parameters, and after every sync
    every rank's parameters, put together by DTensor, are the server's of that round."""
    nprocs = 2 * len(mesh)
    with DiLoCoServer(ServerConfig(port=0, num_workers=2)) as server:
        group = ranks.spawn(tp.tp_rank, (server.address, str(tmp_path), mesh), nprocs=nprocs)
        plain = ranks.spawn(sr.plain_rank, (server.address, 1), nprocs=1)
        ranks.join(group, timeout=180)
        ranks.join(plain, timeout=60)
        status, got = server.status(), server.global_params()
    assert status["round"] == ranks.ROUNDS and status["registrations"] == 2
    results = [torch.load(tmp_path / f"tp{r}.pt") for r in range(nprocs)]
    served = results[0]["served"]
    assert sorted(served) == list(range(1, ranks.ROUNDS + 1))
    for r, res in enumerate(results):
        for name, want in placements.items():  # the sharding is the one under test
            assert res["layout"][name][0] == want, (r, name, res["layout"][name])
        assert [x["outcome"] for x in res["records"]] == ["adopted"] * ranks.ROUNDS, r
        for record in res["records"]:
            for name, full in record["full"].items():
                assert torch.equal(full, served[record["round"]][name]), (r, record["round"], name)
    # No rank holds the first layer's weight whole.
    assert all(res["layout"]["0.weight"][1][0] < 16 for res in results)
    assert set(got) == NAMES
    assert_same_params(got, ranks.reference_groups(2))


def test_a_strided_shard_with_gaps_syncs_as_the_whole_parameter(tmp_path: Path) -> None:
    """A group whose rank 0 holds rows 0-1 and 4-5 of ``w`` (``_StridedShard`` alone: a box
    with gaps, gathered and scattered by index) ends at the same parameters as one process
    moving the whole tensors the same way, and after every sync each rank's shard is torch's
    split of the server's parameter. A checkpoint of such boxes is refused on every rank."""
    with (
        DiLoCoServer(ServerConfig(port=0, num_workers=1)) as sharded,
        DiLoCoServer(ServerConfig(port=0, num_workers=1)) as whole,
    ):
        group = ranks.spawn(tp.strided_rank, (sharded.address, str(tmp_path)))
        plain = ranks.spawn(tp.strided_plain, (whole.address,), nprocs=1)
        ranks.join(group, timeout=120)
        ranks.join(plain, timeout=60)
        got, expected = sharded.global_params(), whole.global_params()
        assert sharded.status()["round"] == whole.status()["round"] == ranks.ROUNDS
    assert set(got) == set(expected) == {"w", "b"}
    for name in expected:
        assert torch.equal(got[name], expected[name]), name
    results = [torch.load(tmp_path / f"strided{r}.pt") for r in range(2)]
    for r, res in enumerate(results):
        assert res["matches"] == [True] * ranks.ROUNDS, r
    assert results[0]["error"] == results[1]["error"]
    assert "parameter 'w' is held in strided boxes" in results[0]["error"]


def test_fsdp_over_tp_group_beside_a_plain_worker_in_allreduce_mode(tmp_path: Path) -> None:
    """All-reduce mode, the same 2x2 ``(dp, tp)`` group (its run state on the strided shards)
    and a plain worker in one quorum: after every round every rank's parameters, put together
    by DTensor, are the plain worker's, and the run ends at the reference."""
    config = ServerConfig(port=0, num_workers=2, allreduce=True)
    with DiLoCoServer(config) as server:
        group = ranks.spawn(tp.tp_rank, (server.address, str(tmp_path), (2, 2), True), nprocs=4)
        plain = ranks.spawn(sar.plain_rank, (server.address, 1, str(tmp_path), False), nprocs=1)
        ranks.join(group, timeout=180)
        ranks.join(plain, timeout=60)
        status = server.status()
    assert status["rounds_completed"] == ranks.ROUNDS and status["registrations"] == 2
    others = torch.load(tmp_path / "plain1.pt")
    for r in range(4):
        res = torch.load(tmp_path / f"tp{r}.pt")
        assert res["layout"]["0.weight"][0] == ["_S(0, 2)", "S(0)"]
        assert [x["outcome"] for x in res["records"]] == ["adopted"] * ranks.ROUNDS, r
        for mine, theirs in zip(res["records"], others, strict=True):
            assert mine["round"] == theirs["round"]
            for name, full in mine["full"].items():
                assert torch.equal(full, theirs["params"][name]), (r, mine["round"], name)
    expected = ranks.reference_groups(2)
    final = torch.load(tmp_path / "tp0.pt")["records"][-1]["full"]
    assert set(final) == NAMES
    for name in expected:
        torch.testing.assert_close(final[name], expected[name])
