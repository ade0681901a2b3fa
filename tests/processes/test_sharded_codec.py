"""Lossy codecs in sharded worker groups (FSDP2, gloo, spawned processes): the error-feedback
residual lives on the owners' shards, rank 0 encodes one parameter at a time, and the run equals
single-process workers with the same codec. Rank-side code is in
``tests/programs/shard_codec_ranks.py``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from diloco import DiLoCoServer, ServerConfig
from tests.helpers import ranks
from tests.programs import shard_codec_ranks as scr

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]

TOL = {"atol": 1e-5, "rtol": 1e-4}
# Chunks of 64 across shards cut at row 8 of the 16x6 weight (element 48): rank 0 encodes
# each parameter whole, so a chunk that two owners share is still one chunk.
TOPK = "topk:density=0.1,chunk=64,bits=4"


def whole_residual(per_rank: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """The residual put together from the ranks' owned boxes (each element owned once)."""
    shapes = {n: p.shape for n, p in ranks.make_model().named_parameters()}
    out = {n: torch.full(s, float("nan")) for n, s in shapes.items()}
    for boxes in per_rank:
        for name, (e, offset) in boxes.items():
            index = tuple(slice(o, o + n) for o, n in zip(offset, e.shape, strict=True))
            assert bool(out[name][index].isnan().all()), name  # owned once
            out[name][index] = e
    return out


def _run(tmp_path: Path, codec: str, mesh: tuple[int, ...]) -> tuple[Any, list[list[Any]]]:
    with DiLoCoServer(ServerConfig(port=0, num_workers=2)) as server:
        groups = [
            ranks.spawn(scr.codec_rank, (server.address, g, str(tmp_path), mesh, codec))
            for g in range(2)
        ]
        for ctx in groups:
            ranks.join(ctx, timeout=120)
        status, got = server.status(), server.global_params()
    assert status["round"] == ranks.ROUNDS and status["registrations"] == 2
    runs = [[torch.load(tmp_path / f"c{g}r{r}.pt") for r in range(2)] for g in range(2)]
    return got, runs


@pytest.mark.parametrize(
    ("codec", "mesh"),
    [("int8", (2,)), ("int8", (2, 1)), ("lowrank:rank=2", (2,)), (TOPK, (2,))],
    ids=["int8-fsdp", "int8-hsdp", "lowrank-fsdp", "topk-fsdp"],
)
def test_two_sharded_groups_with_a_lossy_codec_match_the_reference(
    tmp_path: Path, codec: str, mesh: tuple[int, ...]
) -> None:
    """Two FSDP2 groups of two ranks with a lossy codec equal two single-process workers with
    the same codec on their ranks' mean gradient: the server's parameters, and each group's
    residual put together from its owners equals the reference worker's after the last round,
    its norm the metric on every rank. Each rank's residual is its owned box (replicas of a
    2x1 HSDP mesh keep none), and rank 0 stages at most one parameter per buffer."""
    got, runs = _run(tmp_path, codec, mesh)
    residuals: list[dict[str, torch.Tensor]] = []
    expected = ranks.reference_groups(2, codec, residuals)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], **TOL, msg=name)
    for g, run in enumerate(runs):
        for r, rank in enumerate(run):
            assert [x["outcome"] for x in rank["records"]] == ["adopted"] * ranks.ROUNDS
            last = rank["records"][-1]["residual"]
            assert {n: tuple(e.shape) for n, (e, _) in last.items()} == rank["facts"]["owned"]
            if mesh == (2, 1) and r == 1:
                assert last == {}  # a replica along the Replicate dim keeps no residual
        whole = whole_residual([rank["records"][-1]["residual"] for rank in run])
        norm = sum(float(e.square().sum()) for e in residuals[g].values()) ** 0.5
        for name, e in residuals[g].items():
            torch.testing.assert_close(whole[name], e, **TOL, msg=f"group {g} {name}")
        for rank in run:
            assert rank["records"][-1]["norm"] == pytest.approx(norm, rel=1e-4)
        if mesh == (2,):  # each rank's residual is about half of the model's
            assert sum(e.numel() for e, _ in run[1]["records"][-1]["residual"].values()) < 163 * 0.6
        assert max(run[0]["facts"]["staging"].values()) <= 16 * 6 * 4  # the largest parameter


def test_an_upload_never_counted_leaves_every_ranks_residual(tmp_path: Path) -> None:
    """Rank 0's second body is encoded in full (every parameter gathered from the owners),
    then the server is unreachable: the sync is kept local and every rank's residual is the
    one the first sync left, bit for bit; the third sync commits again."""
    with DiLoCoServer(ServerConfig(port=0, num_workers=1)) as server:
        args = (server.address, 0, str(tmp_path), (2,), "int8", True)
        ranks.join(ranks.spawn(scr.codec_rank, args), timeout=120)
        assert server.status()["round"] == 2
    for r in range(2):
        records = torch.load(tmp_path / f"c0r{r}.pt")["records"]
        assert [x["outcome"] for x in records] == ["adopted", "kept_local", "adopted"], r
        first, kept, third = (x["residual"] for x in records)
        assert first and set(first) == set(kept)
        for name, (e, offset) in first.items():
            assert torch.equal(kept[name][0], e) and kept[name][1] == offset, (r, name)
        assert records[1]["norm"] == records[0]["norm"]
        assert any(not torch.equal(third[n][0], e) for n, (e, _) in first.items())
