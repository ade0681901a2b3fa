"""Checkpoints of the server state: safetensors for tensors, JSON for everything else. No pickle.

The names, the records (``Checkpoint``, ``Entry``), the errors, and the optimizer state as
tensors plus JSON; reading and writing are ``reading.py`` and ``writing.py``.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

FORMAT = "diloco-server-state/1"
NAME = re.compile(r"^round-(\d{9})(?:\.([1-9]\d*))?$")
PREFIX = "round-"
TMP_PREFIX = ".tmp-round-"
TRASH_PREFIX = ".old-round-"
TENSOR_FILES = ("params.safetensors", "optimizer.safetensors")
# Optional: a lossy downlink's true copy (server/params/update_bodies.py).
TRUE_FILE = "true.safetensors"



@dataclass
class Checkpoint:
    path: Path
    round: int
    params: dict[str, torch.Tensor]
    optimizer_state: dict[str, Any]
    extra: dict[str, Any]
    #: The true copy of a lossy downlink's run; None: equal to ``params``.
    true_params: dict[str, torch.Tensor] | None = None


@dataclass(frozen=True)
class Entry:
    """A complete checkpoint folder, placed by its content."""

    path: Path
    round: int
    generation: int

    @property
    def key(self) -> tuple[int, int, str]:
        return (self.round, self.generation, self.path.name)


class NoLoadableCheckpoint(ValueError):
    """The save dir holds checkpoint folders and none of them can be loaded."""

    def __init__(self, root: Path, problems: list[tuple[Path, str]]) -> None:
        self.problems = problems
        lines = "".join(f"\n  {p.name}: {why}" for p, why in problems)
        super().__init__(
            f"{root} holds checkpoint folders but none can be loaded:{lines}\n"
            "refusing to start from scratch beside them; fix or move them, resume with "
            "--from-checkpoint, or pass --fresh-start (ServerConfig.fresh_start) to begin anew "
            "(the folders are left as they are)"
        )


class Torn(ValueError):
    """Why a folder is not a complete checkpoint (without its path)."""


def _jsonable(value: Any, where: str) -> Any:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, (list, tuple)):
        return [_jsonable(v, where) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{where}: non-finite value {value}")
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise ValueError(f"{where}: cannot store {type(value).__name__} in JSON")


def split_optimizer_state(
    state_dict: dict[str, Any],
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for idx, entry in state_dict["state"].items():
        for key, value in entry.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                tensors[f"{idx}/{key}"] = value.detach().contiguous()
            else:
                scalars.setdefault(str(idx), {})[key] = _jsonable(
                    value, f"optimizer state {idx}/{key}"
                )
    groups = [
        {k: _jsonable(v, f"param group {k}") for k, v in g.items()}
        for g in state_dict["param_groups"]
    ]
    return tensors, {"param_groups": groups, "scalars": scalars}


def join_optimizer_state(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict[str, Any]:
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        idx, name = key.split("/", 1)
        state.setdefault(int(idx), {})[name] = value
    for idx, entries in meta["scalars"].items():
        for name, value in entries.items():
            # torch optimizers keep "step" as a tensor; give it back in that form.
            state.setdefault(int(idx), {})[name] = (
                torch.tensor(float(value)) if name == "step" else value
            )
    return {"state": state, "param_groups": meta["param_groups"]}


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    with open(path, "rb+") as fh:
        os.fsync(fh.fileno())

