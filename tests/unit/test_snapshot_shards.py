"""A sharded group's snapshot in a checkpoint (``worker/state/snapshot_shards.py``): each rank's
file holds its boxes and the sharding, and any box, under any other sharding, is read back
exactly from the owners' files."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from diloco.core.shards import Box, all_boxes, coordinates
from diloco.worker.state import snapshot_shards as ss


@dataclass(frozen=True)
class Plan:
    """What ``sharding`` reads of a ``ShardPlan``."""

    shape: tuple[int, ...]
    boxes: tuple[tuple[Box, bool] | None, ...]


def _save(
    folder: Path, full: dict[str, torch.Tensor], mesh: tuple[int, ...], pl: list[str]
) -> None:
    """Every rank of a mesh (row-major ranks) writes its boxes of ``full``."""
    plans = {}
    for name, t in full.items():
        fits = [p if p == "R" or int(p[1:]) < t.dim() else "S0" for p in pl]  # 1-d: rows
        boxes = all_boxes(tuple(t.shape), mesh, fits)
        plans[name] = Plan(tuple(t.shape), tuple(boxes[c] for c in coordinates(mesh)))
    layout = ss.sharding(plans, len(plans[next(iter(plans))].boxes))
    for rank in range(layout["ranks"]):
        mine = {}
        for name, plan in plans.items():
            got = plan.boxes[rank]
            assert got is not None
            mine[name] = full[name][got[0].slices()]
        ss.write_shard(str(folder), rank, mine, layout)


FULL = {
    "w": torch.arange(35, dtype=torch.float32).view(5, 7),  # 5 rows over 2 ranks: 3 + 2
    "b": torch.arange(3, dtype=torch.float32),
    "one": torch.tensor([7.0]),  # 1 row over 2 ranks: 1 + 0 (an empty box)
}


@pytest.mark.parametrize(
    ("saved", "placements"),
    [((2,), ["S0"]), ((2, 2), ["R", "S1"]), ((4,), ["S0"])],
    ids=["fsdp2", "hsdp", "fsdp4"],
)
def test_any_box_reads_back_exactly_under_any_sharding(
    tmp_path: Path, saved: tuple[int, ...], placements: list[str]
) -> None:
    _save(tmp_path, FULL, saved, placements)
    snap = ss.find(str(tmp_path))
    assert snap is not None and snap.ranks == len(list(coordinates(saved)))
    assert sorted(snap) == sorted(FULL)
    for name, t in FULL.items():
        assert torch.equal(snap[name], t), name  # whole (a plain worker's resume)
        for mesh, pl in (((2,), ["S0"]), ((3,), ["S0"]), ((2,), ["S1"]), ((1,), ["R"])):
            if t.dim() < 2 and pl == ["S1"]:
                continue
            for c in coordinates(mesh):
                box = all_boxes(tuple(t.shape), mesh, pl)[c][0]
                assert torch.equal(snap.box(name, box, rank=c[0]), t[box.slices()]), (name, c)


def test_a_rank_with_the_saved_box_reads_its_own_file_alone(tmp_path: Path) -> None:
    _save(tmp_path, FULL, (2,), ["S0"])
    (tmp_path / "diloco_snapshot.rank0.safetensors").rename(tmp_path / "elsewhere")
    snap = ss.ShardedSnapshot(str(tmp_path), 1)
    box = Box((3, 0), (2, 7))  # rank 1's own box of "w"
    assert torch.equal(snap.box("w", box, rank=1), FULL["w"][3:])
    with pytest.raises(ValueError, match=r"needs rank 0's file here, .*rank0\.safetensors"):
        snap.box("w", Box((0, 0), (5, 7)), rank=1)  # another sharding needs rank 0's rows


def test_no_shard_file_is_no_sharded_snapshot(tmp_path: Path) -> None:
    assert ss.find(str(tmp_path)) is None
    assert ss.find(str(tmp_path / "missing")) is None


def test_a_shard_that_cannot_be_written_is_an_oserror(tmp_path: Path) -> None:
    (tmp_path / "diloco_snapshot.rank0.safetensors.tmp").mkdir()  # in the way
    with pytest.raises(OSError, match=r"rank0\.safetensors"):
        ss.write_shard(str(tmp_path), 0, {"b": FULL["b"]}, {"ranks": 1, "params": {}})
    assert ss.find(str(tmp_path)) is None
