"""A relay's closed round between its upstream upload and its publication, on disk.

Once a round's mean is sent upstream the upstream may count it, and the relay's workers' uploads
of that round are inside it: a relay that died then and came back with only its last checkpoint
would have its workers hand those uploads in again, and the upstream would count their steps a
second time (or, sent under the old id, drop the steps the workers had added since). So the
closed round is written here *before* its upload: the mean, its weight and contribution count,
and the submission ids it holds. A restarted relay whose checkpoint is that round's base sends the
same mean under the same id (the upstream counts it once) and answers its workers' re-sent ids
as counted in that round. Written atomically (a temporary file, fsynced, renamed over); the
checkpoint of the next round makes it obsolete (``discard``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

FILE = "relay-pending.safetensors"


@dataclass(frozen=True)
class Pending:
    """One closed round of the relay whose result it has not published."""

    relay_round: int
    base: int  # the upstream round the mean was computed against
    weight: float  # the round's total weight (its contribution count under equal weighting)
    count: int
    receipts: tuple[str, ...]  # the workers' submission ids counted in the round
    mean: dict[str, torch.Tensor]


def write(save_dir: str, pending: Pending) -> None:
    """Blocking: the round on disk, replacing any older one, durably."""
    folder = Path(save_dir)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".tmp-{FILE}"
    meta = {
        "relay_round": str(pending.relay_round),
        "base": str(pending.base),
        "weight": repr(pending.weight),
        "count": str(pending.count),
        "receipts": json.dumps(list(pending.receipts)),
    }
    save_file({n: t.contiguous() for n, t in pending.mean.items()}, str(tmp), metadata=meta)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, folder / FILE)
    _sync_dir(folder)


def read(save_dir: str) -> Pending | None:
    """The round on disk, if any (a torn temporary is never read: only the renamed file)."""
    path = Path(save_dir) / FILE
    if not path.exists():
        return None
    with safe_open(str(path), "pt") as f:
        meta = f.metadata() or {}
    return Pending(
        relay_round=int(meta["relay_round"]),
        base=int(meta["base"]),
        weight=float(meta["weight"]),
        count=int(meta["count"]),
        receipts=tuple(str(s) for s in json.loads(meta["receipts"])),
        mean=load_file(str(path)),
    )


def discard(save_dir: str) -> None:
    path = Path(save_dir) / FILE
    if path.exists():
        path.unlink()
        _sync_dir(path.parent)


def _sync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
