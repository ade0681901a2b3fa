"""Streaming fragments inside a sharded worker group: the two gloo ranks of an FSDP2 group
stream one fragment at a time as ONE worker, each rank gathering and receiving only the
fragment's elements of its own shards, and equal a single-process streaming worker. Rank-side
code and the reference are in ``tests/programs/stream_ranks.py``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from diloco import DiLoCoServer, ServerConfig
from diloco.persistence import list_checkpoints, load_checkpoint
from tests.helpers import ranks
from tests.programs import stream_ranks as sr

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]


def _box(shard: torch.Tensor, offset: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(offset, shard.shape, strict=True))


def _assert_ranks_agree(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> None:
    """The same outcomes, rounds, worker id and counts on both ranks after every step."""
    assert len(a) == len(b)
    for step, (x, y) in enumerate(zip(a, b, strict=True)):
        for key in ("outcome", "round", "worker_id", "metrics"):
            assert x[key] == y[key], (step, key, x[key], y[key])


def _assert_shards_as_reference(
    records: list[dict[str, Any]], expected_steps: list[dict[str, Any]]
) -> None:
    """After every step the same counts as the reference, and each shard its box of the
    reference's parameters."""
    assert len(records) == len(expected_steps)
    for step, (g, e) in enumerate(zip(records, expected_steps, strict=True)):
        assert {k: g["metrics"][k] for k in sr.COUNTED} == e["metrics"], step
        for name, (shard, offset) in g["params"].items():
            want = e["params"][name][_box(shard, offset)]
            torch.testing.assert_close(shard, want, msg=f"step {step}, {name}")


@pytest.mark.parametrize("fragments", [2, 4])
def test_fsdp_group_streams_as_the_single_process_reference(tmp_path: Path, fragments: int) -> None:
    """An FSDP2 group of two ranks streaming P fragments (tau 1; the spans cut parameters in
    the middle, and 2.bias is sharded 2 + 1) through a real server: one registration, the
    ranks agree on every outcome and count, and after every step each rank's shard equals its
    box of a single streaming worker's parameters on the mean gradient; the server ends with
    the same parameters, and rank 0's staging stays one parameter's size."""
    with DiLoCoServer(ServerConfig(port=0, num_workers=1)) as server:
        ctx = ranks.spawn(sr.fsdp_rank, (server.address, str(tmp_path), fragments, 1, False))
        ranks.join(ctx, timeout=120)
        status, got = server.status(), server.global_params()
    with DiLoCoServer(ServerConfig(port=0, num_workers=1)) as ref_server:
        expected_steps = sr.reference_ddp(ref_server.address, fragments, 1)
        expected = ref_server.global_params()
    assert status["registrations"] == 1
    r0, r1 = (torch.load(tmp_path / f"fsdp{r}.pt") for r in range(2))
    _assert_ranks_agree(r0, r1)
    assert r0[-1]["metrics"]["fragments_sent"] == 3 * fragments
    assert r0[0]["outcome"] == "joined"
    assert {x["outcome"] for x in r0[1:]} <= {"joined", "adopted"}
    for records in (r0, r1):
        _assert_shards_as_reference(records[1:], expected_steps)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name])
    # Rank 0's staging: no buffer past the largest parameter (16 x 6 fp32), never the model.
    assert 0 < max(x["staging"] for x in r0) <= 16 * 6 * 4


@pytest.mark.parametrize("fragments", [2, 4])
def test_fsdp_group_streams_in_allreduce_mode_as_the_single_process_reference(
    tmp_path: Path, fragments: int
) -> None:
    """All-reduce mode, tau 0: rank 0's quorum rounds average one fragment's buffer at each due
    step while the outer step and the merge run on the ranks' shards; both ranks agree on every
    outcome and count, and after every step each rank's shard equals its box of a single
    streaming all-reduce worker's parameters on the mean gradient."""
    config = ServerConfig(port=0, num_workers=1, allreduce=True)
    with DiLoCoServer(config) as server:
        ctx = ranks.spawn(sr.fsdp_rank, (server.address, str(tmp_path), fragments, 0, False))
        ranks.join(ctx, timeout=120)
        status = server.status()
    with DiLoCoServer(config) as ref_server:
        expected_steps = sr.reference_ddp(ref_server.address, fragments, 0)
        ref_status = ref_server.status()
    assert status["registrations"] == 1
    assert status["rounds_completed"] == ref_status["rounds_completed"] >= 3 * fragments
    r0, r1 = (torch.load(tmp_path / f"fsdp{r}.pt") for r in range(2))
    _assert_ranks_agree(r0, r1)
    for records in (r0, r1):
        _assert_shards_as_reference(records[1:], expected_steps)
    # Rank 0 holds one fragment's buffer; its staging no more than the largest parameter.
    assert 0 < max(x["staging"] for x in r0) <= 16 * 6 * 4


def test_a_streaming_fsdp_groups_checkpoint_in_allreduce_mode_is_a_plain_members(
    tmp_path: Path,
) -> None:
    """``--save-every 2``: the group's rank 0 writes the server mode's streaming layout from the
    shards (each fragment piece's momentum cut from its parameter gathered from the owners),
    and it equals a single-process streaming member's checkpoint of the same run, round for
    round: parameters, each piece's momentum, the fragments and their rounds; a parameter
    server resumes from it."""
    config = ServerConfig(port=0, num_workers=1, allreduce=True, save_every=2)
    saves = [tmp_path / "group", tmp_path / "plain"]
    with DiLoCoServer(config) as server:
        args = (server.address, str(tmp_path), 2, 0, False, str(saves[0]))
        ranks.join(ranks.spawn(sr.fsdp_rank, args), timeout=120)
    with DiLoCoServer(config) as ref_server:
        sr.reference_ddp(ref_server.address, 2, 0, save_dir=str(saves[1]))
    got, want = (load_checkpoint(list_checkpoints(f)[-1]) for f in saves)
    assert got.round == want.round >= 4
    assert got.extra["fragments"] == want.extra["fragments"] == [2, "sequential"]
    for key in ("unit_rounds", "optimizer_units", "param_order"):
        assert got.extra[key] == want.extra[key], key
    for name, value in want.params.items():
        torch.testing.assert_close(got.params[name], value)
    mine, theirs = got.optimizer_state["state"], want.optimizer_state["state"]
    assert sorted(mine) == sorted(theirs) and len(mine) >= 4
    for i, entry in theirs.items():
        torch.testing.assert_close(mine[i]["momentum_buffer"], entry["momentum_buffer"])
    with DiLoCoServer(ServerConfig(port=0, num_workers=1, save_dir=str(saves[0]))) as resumed:
        assert resumed.status()["round"] == got.round
        for name, value in resumed.global_params().items():
            assert torch.equal(value, got.params[name]), name


def test_faults_on_rank_0_mid_fragment_leave_the_shards_consistent(tmp_path: Path) -> None:
    """Rank 0's scripted client: the 2nd fragment upload finds the server unreachable (kept
    locally, its pseudo-gradient stays in the shards), before the 4th the server forgets the
    worker (410: the next due fragment re-joins with a full download into the shards). Both
    ranks see the same outcomes and counts after every step, neither hangs, and the group ends
    on the server's parameters plus its own progress, every rank's shard of them."""
    with DiLoCoServer(ServerConfig(port=0, num_workers=1)) as server:
        ctx = ranks.spawn(sr.fsdp_rank, (server.address, str(tmp_path), 2, 1, True))
        ranks.join(ctx, timeout=120)
        status = server.status()
    r0, r1 = (torch.load(tmp_path / f"fsdp{r}.pt") for r in range(2))
    _assert_ranks_agree(r0, r1)
    ranks.assert_rank0_faults_survived(r0, status)
