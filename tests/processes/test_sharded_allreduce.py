"""Sharded worker groups (FSDP2 over gloo, spawned processes) in all-reduce mode: the group's
rank 0 takes part in the quorums, reaching the state on its ranks' shards one parameter at a
time. Rank-side code is in ``tests/programs/shard_allreduce_ranks.py``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from diloco import DiLoCoServer, ServerConfig
from diloco.persistence import list_checkpoints, load_checkpoint
from tests.helpers import ranks
from tests.programs import group_ranks as gr
from tests.programs import shard_allreduce_ranks as sar

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]

NAMES = {"0.weight", "0.bias", "2.weight", "2.bias"}


def _load(tmp_path: Path, g: int) -> list[dict[str, Any]]:
    return [torch.load(tmp_path / f"g{g}r{r}.pt") for r in range(2)]


def _slice(full: torch.Tensor, shard: torch.Tensor, offset: tuple[int, ...]) -> torch.Tensor:
    box = tuple(slice(o, o + n) for o, n in zip(offset, shard.shape, strict=True))
    return full[box]


def _whole(group: list[dict[str, Any]], record: int) -> dict[str, torch.Tensor]:
    """The model put together from both ranks' shards after sync ``record``."""
    out: dict[str, torch.Tensor] = {}
    ref = ranks.make_model()
    shapes = {n: p.shape for n, p in ref.named_parameters()}
    for rank in group:
        for name, (shard, offset) in rank["records"][record]["shards"].items():
            full = out.setdefault(name, torch.full(shapes[name], float("nan")))
            _slice(full, shard, offset).copy_(shard)
    return out


def _check_group(group: list[dict[str, Any]], rounds: int, mesh: tuple[int, ...] = (2,)) -> None:
    """Every sync adopted a round, on both ranks alike; each rank's all-reduce state is its
    shard (snapshot, momentum and averaging buffer: rank 0 holds no more of the model)."""
    for rank in group:
        assert [x["outcome"] for x in rank["records"]] == ["adopted"] * rounds
        assert [x["round"] for x in rank["records"]] == list(range(1, rounds + 1))
    assert group[0]["facts"]["worker_id"] == group[1]["facts"]["worker_id"] is not None
    assert group[0]["facts"]["metrics"] == group[1]["facts"]["metrics"]
    last = group[0]["records"][-1]["shards"]
    shard_shapes = {n: tuple(t.shape) for n, (t, _) in last.items()}
    state = group[0]["facts"]["rank0_state"]
    assert group[0]["facts"]["snapshot"] == state["acc"] == state["momentum"] == shard_shapes
    if mesh == (2,):  # (a 2x1 HSDP mesh replicates: each rank holds the whole model)
        assert sum(t.numel() for t, _ in last.values()) < 163 * 0.6
    # Rank 0's staging: no buffer holds more than the largest parameter (16 x 6 fp32).
    assert max(group[0]["facts"]["staging"].values(), default=0) <= 16 * 6 * 4


def _check_by_position(group: list[dict[str, Any]]) -> None:
    """Every round (the join's too) averaged shard with shard on both ranks, and rank 0 put
    no parameter together: not the pseudo-gradient, not the state for its hash."""
    for rank in group:
        assert rank["facts"]["served"]["x_avg"] == ranks.ROUNDS + 1
        assert rank["facts"]["served"]["x_join"] == ranks.ROUNDS + 1
    assert group[0]["facts"]["gathered"] == {}


def _survive_a_dying_member(tmp_path: Path, spawn_dying: Any) -> list[dict[str, Any]]:
    """Group 0 beside a member that exits with code 3 inside its first tensor all-reduce: the
    group's round is discarded on both ranks and a quorum of the group alone repeats it, so the
    group ends where a lone worker ends. Group 0's records."""
    config = ServerConfig(port=0, num_workers=2, allreduce=True, collective_timeout=10.0)
    with DiLoCoServer(config) as server:
        group = ranks.spawn(sar.group_rank, (server.address, 0, str(tmp_path), (2,), "fp32"))
        dying = spawn_dying(server.address)
        with pytest.raises(Exception, match="exit code 3"):
            ranks.join(dying, timeout=60)
        ranks.join(group, timeout=120)
        status = server.status()
    assert status["rounds_completed"] >= ranks.ROUNDS
    got = _load(tmp_path, 0)
    _check_group(got, ranks.ROUNDS)
    assert got[0]["facts"]["metrics"]["discarded_rounds"] >= 1
    expected = ranks.reference_groups(1)
    for name, value in _whole(got, -1).items():
        torch.testing.assert_close(value, expected[name])
    return got


@pytest.mark.parametrize(
    ("mesh", "comm"),
    [((2,), "fp32"), ((2, 1), "fp32"), ((2,), "bf16")],
    ids=["fsdp", "hsdp", "bf16"],
)
def test_two_fsdp_groups_in_allreduce_mode_match_the_reference(
    tmp_path: Path, mesh: tuple[int, ...], comm: str
) -> None:
    """Two FSDP2 groups of two ranks, all-reduce mode: they average shard with shard (rank r
    with rank r, nothing put together on rank 0); after every round each rank's shard equals
    the same box of the other group's (both hold the run's state), and the model equals the
    single-process reference of two workers stepping on their ranks' mean gradient."""
    config = ServerConfig(port=0, num_workers=2, allreduce=True)
    with DiLoCoServer(config) as server:
        groups = [
            ranks.spawn(sar.group_rank, (server.address, g, str(tmp_path), mesh, comm))
            for g in range(2)
        ]
        for ctx in groups:
            ranks.join(ctx, timeout=120)
        status = server.status()
    assert status["rounds_completed"] == ranks.ROUNDS and status["registrations"] == 2
    got = [_load(tmp_path, g) for g in range(2)]
    for g in range(2):
        _check_group(got[g], ranks.ROUNDS, mesh)
        _check_by_position(got[g])
    for r in range(2):  # rank r of each group holds the same box: the same values
        for a, b in zip(got[0][r]["records"], got[1][r]["records"], strict=True):
            for name, (shard, offset) in a["shards"].items():
                assert b["shards"][name][1] == offset
                assert torch.equal(shard, b["shards"][name][0]), (a["round"], name)
    final = _whole(got[0], -1)
    expected = ranks.reference_groups(2)
    assert set(final) == set(expected) == NAMES
    tol = {} if comm == "fp32" else {"atol": 2e-2, "rtol": 2e-2}
    for name in expected:
        torch.testing.assert_close(final[name], expected[name], **tol)


def test_fsdp_group_beside_a_plain_worker_in_allreduce_mode(tmp_path: Path) -> None:
    """A sharded group and a single-process worker of the same model in one quorum (the same
    collectives and hashes): after every round each rank's shard is the plain worker's slice."""
    config = ServerConfig(port=0, num_workers=2, allreduce=True)
    with DiLoCoServer(config) as server:
        group = ranks.spawn(sar.group_rank, (server.address, 0, str(tmp_path), (2,), "fp32"))
        plain = ranks.spawn(sar.plain_rank, (server.address, 1, str(tmp_path), False), nprocs=1)
        ranks.join(group, timeout=120)
        ranks.join(plain, timeout=60)
        status = server.status()
    assert status["rounds_completed"] == ranks.ROUNDS and status["registrations"] == 2
    got = _load(tmp_path, 0)
    _check_group(got, ranks.ROUNDS)
    assert got[0]["facts"]["metrics"]["rebases"] == 0  # the hashes agreed: no resync
    # Another layout in the quorum: each parameter of the pseudo-gradient went through rank
    # 0 once a round.
    assert "x_join" not in got[0]["facts"]["served"]
    assert got[0]["facts"]["gathered"].get("grad") == ranks.ROUNDS * len(NAMES)
    others = torch.load(tmp_path / "plain1.pt")
    for rank in got:
        for mine, theirs in zip(rank["records"], others, strict=True):
            assert mine["round"] == theirs["round"]
            for name, (shard, offset) in mine["shards"].items():
                assert torch.equal(shard, _slice(theirs["params"][name], shard, offset)), name
    expected = ranks.reference_groups(2)
    for name, value in _whole(got, -1).items():
        torch.testing.assert_close(value, expected[name])


def test_an_fsdp_group_a_ddp_group_and_a_plain_worker_average_in_one_quorum(
    tmp_path: Path,
) -> None:
    """All-reduce mode, the three kinds of worker of one model in each quorum (the layouts
    differ: the FSDP group takes the streamed path): after every round the FSDP group's shards
    are the DDP group's and the plain worker's slices, and the run equals the reference."""
    config = ServerConfig(port=0, num_workers=3, allreduce=True)
    with DiLoCoServer(config) as server:
        fsdp = ranks.spawn(sar.group_rank, (server.address, 0, str(tmp_path), (2,), "fp32"))
        ddp = ranks.spawn(gr.ddp_rank, (server.address, 1, str(tmp_path), False))
        plain = ranks.spawn(sar.plain_rank, (server.address, 2, str(tmp_path), False), nprocs=1)
        for ctx in (fsdp, ddp, plain):
            ranks.join(ctx, timeout=120)
        status = server.status()
    assert status["rounds_completed"] == ranks.ROUNDS and status["registrations"] == 3
    got = _load(tmp_path, 0)
    _check_group(got, ranks.ROUNDS)
    assert got[0]["facts"]["metrics"]["rebases"] == 0  # one state: the hashes agreed
    others = torch.load(tmp_path / "plain2.pt")
    ddp_records = torch.load(tmp_path / "g1r0.pt")[1:]  # after every step (the join first)
    for rank in got:
        for i, (mine, theirs) in enumerate(zip(rank["records"], others, strict=True)):
            after_sync = ddp_records[(i + 1) * ranks.SYNC_EVERY - 1]["params"]
            for name, (shard, offset) in mine["shards"].items():
                assert torch.equal(shard, _slice(theirs["params"][name], shard, offset)), name
                assert torch.equal(shard, _slice(after_sync[name], shard, offset)), name
    expected = ranks.reference_groups(3)
    for name, value in _whole(got, -1).items():
        torch.testing.assert_close(value, expected[name])


@pytest.mark.parametrize("source", [True, False], ids=["group-sends", "group-receives"])
def test_a_sharded_group_shares_the_state_with_a_member_that_differs(
    tmp_path: Path, source: bool
) -> None:
    """The plain member starts from another state: at the join the lower worker id's state is
    the run's (``quorum_records.choose``), broadcast from the group's shards parameter by
    parameter, or received into them and checked against the agreed hash; from then on every
    rank's shard is the plain worker's slice after every round."""
    config = ServerConfig(port=0, num_workers=2, allreduce=True)
    ids = ("a-group", "b-plain") if source else ("z-group", "b-plain")
    with DiLoCoServer(config) as server:
        group = ranks.spawn(
            sar.group_rank, (server.address, 0, str(tmp_path), (2,), "fp32", ids[0])
        )
        plain = ranks.spawn(
            sar.plain_rank, (server.address, 1, str(tmp_path), False, True, ids[1]), nprocs=1
        )
        ranks.join(group, timeout=120)
        ranks.join(plain, timeout=60)
        status = server.status()
    assert status["rounds_completed"] == ranks.ROUNDS
    got = _load(tmp_path, 0)
    _check_group(got, ranks.ROUNDS)
    assert got[0]["facts"]["metrics"]["rebases"] == (0 if source else 1)
    others = torch.load(tmp_path / "plain1.pt")
    for rank in got:
        for mine, theirs in zip(rank["records"], others, strict=True):
            for name, (shard, offset) in mine["shards"].items():
                assert torch.equal(shard, _slice(theirs["params"][name], shard, offset)), name
    if source:  # the run started from the group's model: the reference's
        expected = ranks.reference_groups(2)
        for name, value in _whole(got, -1).items():
            torch.testing.assert_close(value, expected[name])


def test_a_member_dying_inside_the_allreduce_leaves_the_sharded_group_consistent(
    tmp_path: Path,
) -> None:
    """The plain member exits inside the first averaging all-reduce: the group's round is
    discarded on both ranks (nothing applied), and a quorum of the group alone repeats it with
    the pseudo-gradient its shards still hold: the group ends where a lone worker ends."""
    got = _survive_a_dying_member(
        tmp_path,
        lambda address: ranks.spawn(sar.plain_rank, (address, 1, str(tmp_path), True), nprocs=1),
    )
    # With the plain member the quorum took the streamed path (a parameter gathered before the
    # all-reduce it died in); alone, the group exchanges by position.
    assert got[0]["facts"]["gathered"].get("grad", 0) >= 1
    assert got[0]["facts"]["served"]["x_avg"] >= ranks.ROUNDS


def test_a_group_dying_inside_the_exchange_by_position_leaves_the_other_consistent(
    tmp_path: Path,
) -> None:
    """Two FSDP2 groups exchanging shard with shard; the second group's rank 1 exits inside the
    first tensor all-reduce of position 1 (position 0 completes). The first group's rank 1
    reports the failure, its rank 0 discards the round on both ranks, and a quorum of the group
    alone repeats it: the group ends where a lone worker ends."""
    got = _survive_a_dying_member(
        tmp_path,
        lambda address: ranks.spawn(
            sar.group_rank, (address, 1, str(tmp_path), (2,), "fp32", None, None, True)
        ),
    )
    assert got[0]["facts"]["served"]["x_avg"] >= ranks.ROUNDS  # shard with shard, then alone
    assert got[0]["facts"]["gathered"] == {}  # it put nothing together, alone or not


def test_groups_of_one_layout_share_the_state_position_by_position(tmp_path: Path) -> None:
    """The second group starts from another state: at the join the first group's state (the
    lower worker id's) goes from each of its ranks to the same rank of the other group, the
    receiver checks the agreed hash and rebases; nothing is put together on either rank 0, and
    from then on both groups hold the same shards and train as the reference."""
    config = ServerConfig(port=0, num_workers=2, allreduce=True)
    with DiLoCoServer(config) as server:
        groups = [
            ranks.spawn(
                sar.group_rank,
                (server.address, g, str(tmp_path), (2,), "fp32", f"{'ab'[g]}-group")
                + (None, False, g == 1),
            )
            for g in range(2)
        ]
        for ctx in groups:
            ranks.join(ctx, timeout=120)
    got = [_load(tmp_path, g) for g in range(2)]
    for g in range(2):
        _check_group(got[g], ranks.ROUNDS)
        _check_by_position(got[g])
        for rank in got[g]:
            assert rank["facts"]["served"]["x_bcast"] == 1
    assert [got[g][0]["facts"]["metrics"]["rebases"] for g in range(2)] == [0, 1]
    for r in range(2):
        for a, b in zip(got[0][r]["records"], got[1][r]["records"], strict=True):
            for name, (shard, _) in a["shards"].items():
                assert torch.equal(shard, b["shards"][name][0]), (a["round"], name)
    expected = ranks.reference_groups(2)
    for name, value in _whole(got[0], -1).items():
        torch.testing.assert_close(value, expected[name])


def test_rank_0_of_a_sharded_group_saves_a_checkpoint_a_server_resumes_from(
    tmp_path: Path,
) -> None:
    """``--save-every 3``: the quorum's rank 0 is a sharded group (the lower worker id); it
    writes the run's state one parameter at a time from its shards, in the server mode's
    layout: the parameters are the group's shards put together, bit for bit, the momentum of
    every parameter is there, and a parameter server started on the folder serves them."""
    saves = [tmp_path / "save0", tmp_path / "save1"]
    config = ServerConfig(port=0, num_workers=2, allreduce=True, save_every=3)
    with DiLoCoServer(config) as server:
        groups = [
            ranks.spawn(
                sar.group_rank,
                (server.address, g, str(tmp_path), (2,), "fp32", f"{'ab'[g]}-group", str(saves[g])),
            )
            for g in range(2)
        ]
        for ctx in groups:
            ranks.join(ctx, timeout=120)
    got = _load(tmp_path, 0)
    _check_group(got, ranks.ROUNDS)
    assert not saves[1].exists()  # only the quorum's rank 0 saves
    folders = list_checkpoints(saves[0])
    assert [load_checkpoint(f).round for f in folders] == [ranks.ROUNDS]
    ckpt = load_checkpoint(folders[-1])
    final = _whole(got, -1)
    assert set(ckpt.params) == NAMES
    for name, value in final.items():
        assert torch.equal(ckpt.params[name], value), name
    state = ckpt.optimizer_state["state"]
    order = ckpt.extra["param_order"]
    assert sorted(state) == list(range(len(NAMES)))
    for i, entry in state.items():
        buf = entry["momentum_buffer"]
        assert buf.shape == final[order[i]].shape and float(buf.abs().sum()) > 0
    with DiLoCoServer(ServerConfig(port=0, num_workers=1, save_dir=str(saves[0]))) as server:
        assert server.status()["round"] == ranks.ROUNDS
        served = server.global_params()
    for name, value in final.items():
        assert torch.equal(served[name], value), name
