"""Checkpoints of the server state: safetensors for tensors, JSON for everything else. No pickle.

Layout of one checkpoint, ``<save_dir>/round-000012/``:
- ``params.safetensors``: the global parameters by name (loads into a model with
  ``safetensors.torch.load_file`` and ``load_state_dict``);
- ``optimizer.safetensors``: the outer optimizer's tensor state, keyed ``<param index>/<key>``;
- ``state.json``: round, optimizer param groups and scalars, counters. Written last.

A checkpoint is written into a temporary directory, fsynced, and renamed into place, so a crash
leaves either the previous checkpoints or a complete new one. A directory without a readable
``state.json`` is torn and skipped.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

log = logging.getLogger(__name__)

FORMAT = "diloco-server-state/1"
NAME = re.compile(r"^round-(\d{9})$")


@dataclass
class Checkpoint:
    path: Path
    round: int
    params: dict[str, torch.Tensor]
    optimizer_state: dict[str, Any]
    extra: dict[str, Any]


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


def _split_optimizer_state(
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


def _join_optimizer_state(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict[str, Any]:
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


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as fh:
        os.fsync(fh.fileno())


def save_checkpoint(
    save_dir: str | Path,
    round: int,
    params: dict[str, torch.Tensor],
    optimizer_state: dict[str, Any],
    extra: dict[str, Any],
    keep: int,
) -> Path:
    """Write one checkpoint atomically and delete all but the newest ``keep``."""
    root = Path(save_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"round-{round:09d}"
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-round-{round:09d}-", dir=root))
    try:
        opt_tensors, opt_meta = _split_optimizer_state(optimizer_state)
        save_file({k: v.contiguous() for k, v in params.items()}, str(tmp / "params.safetensors"))
        save_file(opt_tensors, str(tmp / "optimizer.safetensors"))
        state = {"format": FORMAT, "round": round, "optimizer": opt_meta, "extra": extra}
        (tmp / "state.json").write_text(json.dumps(state, indent=1, sort_keys=True))
        for name in ("params.safetensors", "optimizer.safetensors", "state.json"):
            _fsync_file(tmp / name)
        _fsync_dir(tmp)
        if final.exists():  # saved twice at the same round (shutdown right after a periodic save)
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in list_checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(save_dir: str | Path) -> list[Path]:
    """Checkpoint directories, oldest first (complete or not)."""
    root = Path(save_dir)
    if not root.is_dir():
        return []
    return sorted(
        (p for p in root.iterdir() if p.is_dir() and NAME.match(p.name)), key=lambda p: p.name
    )


def load_checkpoint(path: str | Path) -> Checkpoint:
    path = Path(path)
    try:
        state = json.loads((path / "state.json").read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path} is not a complete checkpoint: {exc}") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError(
            f"{path}: unknown checkpoint format {state.get('format') if isinstance(state, dict) else state!r}"
        )
    try:
        params = load_file(str(path / "params.safetensors"))
        opt_tensors = load_file(str(path / "optimizer.safetensors"))
    except Exception as exc:  # safetensors raises its own error types for torn files
        raise ValueError(f"{path}: unreadable tensors: {exc}") from None
    return Checkpoint(
        path,
        int(state["round"]),
        params,
        _join_optimizer_state(opt_tensors, state["optimizer"]),
        state.get("extra", {}),
    )


def latest_checkpoint(save_dir: str | Path) -> Checkpoint | None:
    """The newest complete checkpoint; torn ones are skipped with a warning."""
    for path in reversed(list_checkpoints(save_dir)):
        try:
            return load_checkpoint(path)
        except ValueError as exc:
            log.warning("skipping torn checkpoint: %s", exc)
    return None
