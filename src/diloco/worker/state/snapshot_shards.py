"""A sharded worker group's snapshot in a checkpoint: one file per rank, each holding that rank's
boxes (docs/design/groups.md, "Sharded groups", Checkpoints).

No rank of a sharded group holds the whole snapshot, so none writes it: rank R writes
``diloco_snapshot.rank{R}.safetensors`` with the fp32 box of every parameter it holds, and in the
file's metadata the sharding it was saved under (every rank's box of every parameter, and which
rank owns each box), so any one file says where every element lies.

Reading (``ShardedSnapshot``) is by box: a rank asks for the box it holds now and gets it from
its own file when the sharding is the same, or otherwise put together from the overlapping
owned boxes of the saved ranks' files (a different world size, mesh or placement: re-sliced,
never the whole parameter in memory). A plain worker may read whole parameters the same way.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from diloco.core.shards import Box

SHARD_FILE = "diloco_snapshot.rank{rank}.safetensors"
_SHARD_RE = re.compile(r"^diloco_snapshot\.rank(\d+)\.safetensors$")
_KEY = "diloco_sharding"

Sharding = dict[str, Any]
"""``{"ranks": N, "params": {name: {"shape": S, "boxes": [[offset, shape, owns] | None]}}}``:
per parameter, per group rank, the box it holds (None: nothing, a plain parameter off rank 0);
``"residual": true`` when the owners' files also hold their residual boxes (``residual/NAME``)."""


def sharding(plans: Mapping[str, Any], ranks: int) -> Sharding:
    """The sharding of a group's ``ShardPlan``s, as JSON."""
    params = {}
    for name, plan in plans.items():
        if any(b is not None and b[0].strided for b in plan.boxes):
            raise ValueError(  # the file layout names boxes by offset and extent only
                f"parameter {name!r} is held in strided boxes (gaps between a rank's indices): "
                "a sharded group's checkpoint cannot save those yet"
            )
        boxes = [
            None if b is None else [list(b[0].offset), list(b[0].shape), bool(b[1])]
            for b in plan.boxes
        ]
        params[name] = {"shape": list(plan.shape), "boxes": boxes}
    return {"ranks": ranks, "params": params}


def write_shard(
    folder: str,
    rank: int,
    snapshot: Mapping[str, torch.Tensor],
    layout: Sharding,
    extra: Mapping[str, torch.Tensor] | None = None,
) -> str:
    """Write this rank's snapshot boxes into ``folder``; the path written. ``extra``: more
    tensors of this rank's boxes under their own keys (its error-feedback residual boxes,
    ``residual/NAME``, which ``box(..., key=)`` reads back re-sliced as the snapshot is). The
    file goes in under a temporary name and is renamed, so a reader never sees half of it; an
    ``OSError`` if it cannot be written."""
    path = os.path.join(folder, SHARD_FILE.format(rank=rank))
    tensors = {
        n: t.detach().to("cpu", copy=True).contiguous()
        for n, t in {**snapshot, **(extra or {})}.items()
    }
    try:
        save_file(tensors, path + ".tmp", metadata={_KEY: json.dumps(layout)})
    except SafetensorError as exc:  # its I/O errors are not OSErrors
        raise OSError(f"{path}: {exc}") from exc
    os.replace(path + ".tmp", path)
    return path


def find(folder: str) -> ShardedSnapshot | None:
    """The sharded snapshot in a checkpoint ``folder``; None when it holds no shard file."""
    if not os.path.isdir(folder):
        return None
    ranks = sorted(int(m.group(1)) for f in os.listdir(folder) if (m := _SHARD_RE.match(f)))
    return ShardedSnapshot(folder, ranks[0]) if ranks else None


class ShardedSnapshot(Mapping[str, torch.Tensor]):
    """The snapshot shards of a checkpoint ``folder``, read lazily by box. As a mapping, each
    parameter whole (for a plain worker resuming from a group's checkpoint)."""

    def __init__(self, folder: str, any_rank: int) -> None:
        self.folder = folder
        with safe_open(self._path(any_rank), "pt") as f:
            meta = f.metadata() or {}
        if _KEY not in meta:
            raise ValueError(f"{self._path(any_rank)} holds no DiLoCo sharding")
        self.layout: Sharding = json.loads(meta[_KEY])

    @property
    def has_residual(self) -> bool:
        """Whether the owners' files hold their error-feedback residual boxes."""
        return bool(self.layout.get("residual"))

    @property
    def ranks(self) -> int:
        return int(self.layout["ranks"])

    def __getitem__(self, name: str) -> torch.Tensor:
        shape = tuple(self.layout["params"][name]["shape"])
        return self.box(name, Box((0,) * len(shape), shape))

    def __iter__(self) -> Iterator[str]:
        return iter(self.layout["params"])

    def __len__(self) -> int:
        return len(self.layout["params"])

    def shape(self, name: str) -> tuple[int, ...]:
        """Parameter ``name``'s global shape."""
        return tuple(self.layout["params"][name]["shape"])

    def box(
        self, name: str, want: Box, rank: int | None = None, key: str | None = None
    ) -> torch.Tensor:
        """The fp32 values of ``want`` (a box of parameter ``name``). ``rank``: the reader's
        group rank, whose own file is read alone when it holds exactly ``want``. ``key``: read
        the tensor saved under that key instead of the snapshot (a residual, which only the
        owners' files hold), with the same boxes."""
        saved = self._boxes(name)
        own = saved[rank] if rank is not None and rank < len(saved) else None
        if own is not None and rank is not None:
            if own[0] == want and (own[1] or key is None):
                return self._read(rank, key or name, tuple(slice(0, n) for n in want.shape))
        out = torch.empty(want.shape, dtype=torch.float32)
        covered = 0
        for r, got in enumerate(saved):
            if got is None or not got[1]:
                continue  # replicas of an owned box: the owner's file has the same values
            cut = _overlap(got[0], want)
            if cut is None:
                continue
            lo, hi = cut
            source = tuple(
                slice(a - o, b - o) for a, b, o in zip(lo, hi, got[0].offset, strict=True)
            )
            target = tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, want.offset, strict=True))
            out[target] = self._read(r, key or name, source)
            covered += _numel([b - a for a, b in zip(lo, hi, strict=True)])
        assert covered == want.numel, (name, want)  # the owned boxes tile it once (checked at save)
        return out

    def describe(self) -> str:
        """The sharding in words, for errors: the ranks and each rank's box of the first
        parameter."""
        name = next(iter(self.layout["params"]), None)
        if name is None:
            return f"{self.ranks} ranks"
        boxes = [None if b is None else tuple(b[1]) for b in self.layout["params"][name]["boxes"]]
        return f"{self.ranks} ranks, holding {boxes} of {name!r}"

    def _boxes(self, name: str) -> list[tuple[Box, bool] | None]:
        if name not in self.layout["params"]:
            raise ValueError(f"the checkpoint's DiLoCo snapshot has no parameter {name!r}")
        return [
            None if b is None else (Box(tuple(b[0]), tuple(b[1])), bool(b[2]))
            for b in self.layout["params"][name]["boxes"]
        ]

    def _path(self, rank: int) -> str:
        return os.path.join(self.folder, SHARD_FILE.format(rank=rank))

    def _read(self, rank: int, name: str, index: Sequence[slice]) -> torch.Tensor:
        path = self._path(rank)
        if not os.path.isfile(path):
            raise ValueError(
                f"the checkpoint's DiLoCo snapshot, saved by a sharded group of "
                f"{self.describe()}, needs rank {rank}'s file here, {path}, which is not there"
            )
        with safe_open(path, "pt") as f:
            if not index:  # a 0-d parameter
                return f.get_tensor(name).to(torch.float32)
            if any(s.stop == s.start for s in index):
                return torch.empty([s.stop - s.start for s in index], dtype=torch.float32)
            return f.get_slice(name)[tuple(index)].to(torch.float32)


def _overlap(a: Box, b: Box) -> tuple[list[int], list[int]] | None:
    lo = [max(x, y) for x, y in zip(a.offset, b.offset, strict=True)]
    hi = [
        min(x + n, y + m) for x, n, y, m in zip(a.offset, a.shape, b.offset, b.shape, strict=True)
    ]
    return (lo, hi) if all(h > lo_ for lo_, h in zip(lo, hi, strict=True)) or not lo else None


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
