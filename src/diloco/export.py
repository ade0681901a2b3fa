"""A run's parameters written as a model folder like the one the run started from
(``export_like``, ``diloco export``); ``diloco.loading`` puts them into a model instead.

A checkpoint holds the global parameters under their wire names (``diloco.core.names``), each
tied tensor once, whatever wrapped or sharded the workers' models: an export gives them back
the original folder's names, shapes and dtypes.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from diloco.loading import few_names, read_params
from diloco.persistence.weights import read_weights

log = logging.getLogger(__name__)

EXPORT_FILE = "model.safetensors"  # the name ``from_pretrained`` looks for first
# Weight files of a model folder: not copied by an export, whose model.safetensors replaces them.
WEIGHT_SUFFIXES = (
    ".safetensors",
    ".safetensors.index.json",
    ".bin",
    ".bin.index.json",
    ".pt",
    ".pth",
)
WEIGHT_FILES = frozenset({"tf_model.h5", "flax_model.msgpack"})


def _is_weights(name: str) -> bool:
    return name in WEIGHT_FILES or name.endswith(WEIGHT_SUFFIXES)


def _original(like: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors of a model folder's safetensors files and the first file's metadata. A
    folder without any, whose weights are a PyTorch state dict (``pytorch_model.bin``), is read
    as ``--init`` read it (the restricted loader) and has no metadata; its export is a
    ``model.safetensors`` all the same."""
    files = sorted(like.glob("*.safetensors"))
    if not files:
        try:
            return read_weights(like), {}
        except ValueError as exc:
            raise ValueError(f"{exc}: export needs the folder the run began from") from None
    tensors: dict[str, torch.Tensor] = {}
    with safe_open(str(files[0]), framework="pt") as fh:
        metadata = dict(fh.metadata() or {})
    for file in files:
        for name, tensor in load_file(str(file)).items():
            if name in tensors:
                raise ValueError(f"tensor {name!r} appears in more than one file under {like}")
            tensors[name] = tensor
    return tensors, metadata


def exported_tensors(
    params: dict[str, torch.Tensor], original: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The original folder's tensors with the trained values: each original name, shape and
    dtype. Tensors that are not floating point (position ids) are not trained and are kept as
    they were; a trained name the original lacks, or the reverse, is an error."""
    out: dict[str, torch.Tensor] = {}
    missing = []
    for name, old in original.items():
        new = params.get(name)
        if new is None:
            if old.is_floating_point():
                missing.append(name)
            out[name] = old
            continue
        if tuple(new.shape) != tuple(old.shape):
            raise ValueError(f"{name!r}: shape {tuple(new.shape)}, {tuple(old.shape)} originally")
        out[name] = new.to(old.dtype).contiguous()
    unexpected = sorted(set(params) - set(original))
    if missing or unexpected:
        raise ValueError(
            "the checkpoint does not fit the original model folder: "
            f"not in the checkpoint {few_names(missing)}, not in the folder {few_names(unexpected)}"
        )
    return out


STAGE_PREFIX = "stage-"
"""A pipeline swarm's save dir holds one folder per stage (``stage-0``, ``stage-1``, ...): each
stage's quorums checkpoint its own parameters there, under the unsplit model's names."""


def stage_folders(path: str | Path) -> list[Path]:
    """The ``stage-K`` folders of a swarm's save dir, by ``K`` (none for any other path)."""
    path = Path(path)
    if not path.is_dir():
        return []
    found = [
        (int(p.name[len(STAGE_PREFIX) :]), p)
        for p in path.iterdir()
        if p.is_dir() and p.name.startswith(STAGE_PREFIX) and p.name[len(STAGE_PREFIX) :].isdigit()
    ]
    return [p for _, p in sorted(found)]


def checkpoint_params(checkpoint: str | Path) -> dict[str, torch.Tensor]:
    """The parameters of a checkpoint (``loading.read_params``), or, for a swarm's save dir,
    every stage's newest checkpoint joined into one model (each stage's own round: the stages
    sync apart). A name in two stages' checkpoints is an error."""
    stages = stage_folders(checkpoint)
    if not stages:
        return read_params(checkpoint)
    joined: dict[str, torch.Tensor] = {}
    for folder in stages:
        for name, tensor in read_params(folder).items():
            if name in joined:
                raise ValueError(
                    f"{name!r} is in more than one stage's checkpoint under {checkpoint}"
                )
            joined[name] = tensor
    log.info("joined the checkpoints of %d stages under %s", len(stages), checkpoint)
    return joined


def export_like(checkpoint: str | Path, like: str | Path, out: str | Path) -> Path:
    """Write ``out``, a model folder like ``like`` (the folder a run began from with
    ``--init``) holding the checkpoint's parameters (a pipeline swarm's save dir: its stages'
    joined, ``checkpoint_params``): the original's other files (config,
    tokenizer) copied, its weights replaced by one ``model.safetensors`` under the original names
    and dtypes, which ``from_pretrained`` opens. Built in a temporary folder beside ``out`` and
    renamed into place, so ``out`` is either absent or complete."""
    like, out = Path(like), Path(out)
    if not like.is_dir():
        raise ValueError(f"--like must be a model folder: {like}")
    if out.exists():
        raise ValueError(f"{out} exists; export writes a new folder")
    original, metadata = _original(like)
    tensors = exported_tensors(checkpoint_params(checkpoint), original)
    metadata.setdefault("format", "pt")  # transformers refuses a file without it
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        for entry in sorted(like.iterdir()):
            if entry.is_file() and not _is_weights(entry.name):
                shutil.copy2(entry, tmp / entry.name)
            elif entry.is_dir():
                log.info("not copying the folder %s", entry)
        save_file(tensors, str(tmp / EXPORT_FILE), metadata=metadata)
        # mkdtemp makes the folder 0700 whatever the umask; a model folder is shared like any
        # other the user creates.
        mask = _umask()
        os.chmod(tmp, 0o777 & ~mask)
        os.chmod(tmp / EXPORT_FILE, 0o666 & ~mask)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("exported %s as %s (%d tensors)", checkpoint, out, len(tensors))
    return out


def _umask() -> int:
    """The process's umask (reading it means setting it: set back at once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _flag(help: str, **cli: Any) -> Any:
    return field(default=None, metadata={"help": help, **cli})


@dataclass(frozen=True)
class ExportConfig:
    """``diloco export``: a checkpoint as a model folder like the one the run began from."""

    checkpoint: str | None = _flag(
        "a checkpoint folder (round-N), its params.safetensors, a save dir (its newest), or a "
        "pipeline swarm's save dir (its stage-K folders' newest, joined)",
        metavar="PATH",
    )
    """The checkpoint to export (``checkpoint_file`` says which paths are accepted; a swarm's
    save dir: ``checkpoint_params``)."""

    like: str | None = _flag(
        "the model folder the run began from (diloco server --init): its names, dtypes, config "
        "and tokenizer",
        metavar="DIR",
    )
    """The original model folder."""

    out: str | None = _flag("the folder to write (must not exist)", metavar="DIR")
    """Where the exported folder goes."""

    def __post_init__(self) -> None:
        for name in ("checkpoint", "like", "out"):
            if not getattr(self, name):
                raise ValueError(f"diloco export needs --{name}")
