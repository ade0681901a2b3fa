"""A sharded worker group's checkpoint: every FSDP2 rank saves its snapshot shard, the group dies
mid-round, and new processes resume from the checkpoint as the same worker and end where an
uninterrupted run ends; also under another sharding than the one it was saved under (the boxes
re-sliced). Rank-side code is in ``tests/programs/shard_resume.py``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from diloco import DiLoCoServer, ServerConfig
from diloco.worker import resume
from diloco.worker.state.encoder import RESIDUAL
from tests.helpers import ranks
from tests.helpers.reference import assert_same_params
from tests.programs import shard_resume as sr

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]


def _resume(
    tmp_path: Path,
    saved_mesh: tuple[int, ...],
    resumed_mesh: tuple[int, ...],
    codec: str | None = None,
) -> Any:
    with DiLoCoServer(ServerConfig(port=0, num_workers=1)) as server:
        args = (server.address, str(tmp_path), saved_mesh, False, codec)
        first = ranks.spawn(sr.first_rank, args)
        ranks.join(first, timeout=90)
        args = (server.address, str(tmp_path), resumed_mesh, codec)
        again = ranks.spawn(sr.again_rank, args)
        ranks.join(again, timeout=90)
        status, got = server.status(), server.global_params()
    firsts = [torch.load(tmp_path / f"first{r}.pt") for r in range(2)]
    agains = [torch.load(tmp_path / f"again{r}.pt") for r in range(2)]
    return status, got, firsts, agains


def _check_resumed(
    status: Any, got: Any, firsts: Any, agains: Any, codec: str | None = None
) -> None:
    assert status["round"] == ranks.ROUNDS
    assert status["registrations"] == 1  # the resumed group re-joined under the first one's id
    worker_id = firsts[0]["worker_id"]
    for r in range(2):
        assert agains[r]["worker_id"] == worker_id, r
        assert agains[r]["local_step"] == sr.SAVE_AT % ranks.SYNC_EVERY, r
        assert agains[r]["outcomes"] == ["adopted"] * (ranks.ROUNDS - 1), r
        # The server did not move on: the resumed shards are the checkpoint's model.
        for name, (shard, _) in agains[r]["begin"].items():
            torch.testing.assert_close(shard, agains[r]["loaded"][name][0], msg=name)
    # An uninterrupted group (the reference the group tests use) ends at the same parameters.
    # With a lossy codec, only if the residual came back: the resumed group sends what its
    # codec dropped before the checkpoint.
    expected = ranks.reference_groups(1, codec)
    if codec is None:
        assert_same_params(got, expected)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], atol=1e-5, rtol=1e-4, msg=name)


def test_fsdp_group_resumes_from_its_checkpoint_as_the_same_worker(tmp_path: Path) -> None:
    status, got, firsts, agains = _resume(tmp_path, (2,), (2,))
    _check_resumed(status, got, firsts, agains)
    folder = tmp_path / "ckpt"
    # No whole snapshot anywhere: each rank's file holds its own shards only.
    assert not (folder / resume.SNAPSHOT_FILE).exists()
    for r in range(2):
        with safe_open(str(folder / f"diloco_snapshot.rank{r}.safetensors"), "pt") as f:
            shapes = {n: tuple(f.get_slice(n).get_shape()) for n in f.keys()}  # noqa: SIM118
        assert shapes == {n: tuple(t.shape) for n, (t, _) in firsts[r]["shards"].items()}, r
    assert (folder / resume.STATE_FILE).is_file()


def test_fsdp_checkpoint_resumes_under_another_sharding(tmp_path: Path) -> None:
    """Saved by a 1-D FSDP mesh (each rank half of every parameter), resumed by a 2x1 HSDP mesh
    (each rank all of it): every rank's boxes are put together from both saved files."""
    status, got, firsts, agains = _resume(tmp_path, (2,), (2, 1))
    _check_resumed(status, got, firsts, agains)
    for r in range(2):
        for name, (shard, _) in agains[r]["begin"].items():
            assert shard.shape == ranks.make_model().state_dict()[name].shape


def test_failed_shard_writes_and_reads_fail_on_every_rank(tmp_path: Path) -> None:
    """Rank 1 cannot write its shard: both ranks raise the same error and no counters are
    written. Rank 1's snapshot file is gone when resuming (another machine's disk): both ranks
    fail with the same error naming the file, before the join."""

    def drop_rank_1(path: Path) -> None:
        (path / "ckpt" / "diloco_snapshot.rank1.safetensors").unlink()

    with DiLoCoServer(ServerConfig(port=0, num_workers=1)) as server:
        first = ranks.spawn(sr.first_rank, (server.address, str(tmp_path), (2,), True))
        ranks.join(first, timeout=90)
        drop_rank_1(tmp_path)
        again = ranks.spawn(sr.again_rank, (server.address, str(tmp_path), (2,)))
        ranks.join(again, timeout=90)
        status = server.status()
    assert status["round"] == 1  # the first run's one round, nothing since
    written = [torch.load(tmp_path / f"first{r}.pt")["errors"] for r in range(2)]
    assert written[0] == written[1] and len(written[0]) == 1
    assert written[0][0].startswith("rank 1 of the sharded worker group could not save")
    assert not (tmp_path / "blocked" / resume.STATE_FILE).exists()
    assert (tmp_path / "blocked" / "diloco_snapshot.rank0.safetensors").is_file()
    errors = [torch.load(tmp_path / f"again{r}.pt")["error"] for r in range(2)]
    assert errors[0] == errors[1]
    assert errors[0].startswith("rank 1 of the sharded worker group cannot resume")
    assert "diloco_snapshot.rank1.safetensors" in errors[0]


@pytest.mark.parametrize("resumed_mesh", [(2,), (2, 1)], ids=["same", "hsdp"])
def test_fsdp_group_with_int8_resumes_its_residual(
    tmp_path: Path, resumed_mesh: tuple[int, ...]
) -> None:
    """A group with int8 saves after a committed sync: each rank's file holds its owned
    residual boxes beside its snapshot boxes, and the resumed ranks get them back, bit for
    bit (under a 2x1 HSDP mesh re-sliced: rank 0 owns the whole residual, the replica none);
    the run then ends where an uninterrupted one with int8 ends."""
    status, got, firsts, agains = _resume(tmp_path, (2,), resumed_mesh, "int8")
    _check_resumed(status, got, firsts, agains, "int8")
    for r in range(2):
        assert firsts[r]["residual"], r  # committed at the first sync
        with safe_open(str(tmp_path / "ckpt" / f"diloco_snapshot.rank{r}.safetensors"), "pt") as f:
            keys = set(f.keys())
        assert {RESIDUAL + n for n in firsts[r]["residual"]} <= keys
    if resumed_mesh == (2,):
        for r in range(2):
            assert set(agains[r]["residual"]) == set(firsts[r]["residual"])
            for name, (e, offset) in firsts[r]["residual"].items():
                assert torch.equal(agains[r]["residual"][name][0], e), (r, name)
                assert agains[r]["residual"][name][1] == offset
        return
    assert agains[1]["residual"] == {}
    for name, (e, _) in agains[0]["residual"].items():
        parts = [firsts[r]["residual"][name] for r in range(2)]
        whole = torch.cat([t for t, _ in sorted(parts, key=lambda p: p[1])], dim=0)
        assert torch.equal(e, whole), name
