"""A run's parameters back into the user's hands: loaded into their model (``load_into``), or
written as a model folder like the one the run started from (``export_like``, ``diloco export``).

A checkpoint holds the global parameters under their wire names (``diloco.core.names``): no
wrapper prefixes, and each tied tensor once, under the name ``named_parameters()`` keeps (GPT-2's
``transformer.wte.weight``, not ``lm_head.weight``). So ``load_state_dict`` of a checkpoint fails
on a wrapped model or a tied one; ``load_into`` matches names without prefixes and gives every
name of a tied tensor the value saved under any one of them.
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

from diloco.core.names import wire_name, wire_names
from diloco.persistence.weights import read_weights

log = logging.getLogger(__name__)

PARAMS_FILE = "params.safetensors"  # a checkpoint folder's parameters (diloco.persistence)
EXPORT_FILE = "model.safetensors"  # the name ``from_pretrained`` looks for first
# Weight files of a model folder: not copied by an export, whose model.safetensors replaces them.
WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json", ".pt", ".pth")
WEIGHT_FILES = frozenset({"tf_model.h5", "flax_model.msgpack"})


@dataclass(frozen=True)
class LoadReport:
    """What ``load_into`` did, by wire name."""

    loaded: list[str]
    """Model names that took a value, tied aliases included."""

    tied: dict[str, str]
    """Each tied alias the file does not hold, and the name whose value it took
    (``{"lm_head.weight": "transformer.wte.weight"}``)."""

    missing: list[str]
    """Model parameters the file holds no value for (buffers are not required)."""

    unexpected: list[str]
    """Names in the file that no parameter or buffer of the model has."""


def checkpoint_file(path: str | Path) -> Path:
    """The parameters file of ``path``: a ``.safetensors`` file, a checkpoint folder
    (``round-000000012``), or a save dir (its newest complete checkpoint)."""
    path = Path(path)
    if path.is_file():
        return path
    if (path / PARAMS_FILE).is_file():
        return path / PARAMS_FILE
    if path.is_dir():
        from diloco.persistence import list_checkpoints

        found = list_checkpoints(path)
        if found:
            return found[-1] / PARAMS_FILE
        raise ValueError(f"{path} holds neither {PARAMS_FILE} nor a complete checkpoint folder")
    raise ValueError(f"checkpoint not found: {path}")


def read_params(path: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of ``checkpoint_file(path)`` by wire name (a file written with wrapper
    prefixes loads too; two names that become one are an error)."""
    file = checkpoint_file(path)
    try:
        tensors = load_file(str(file))
    except Exception as exc:  # safetensors raises its own error types for torn files
        raise ValueError(f"{file}: unreadable tensors: {exc}") from None
    return wire_names(tensors.items())


def _model_tensors(model: torch.nn.Module) -> dict[str, list[tuple[str, torch.Tensor, bool]]]:
    """The model's tensors grouped by identity: each group is one tensor under all its names
    (tied parameters share a group), each name a wire name, with whether it is a parameter."""
    groups: dict[int, list[tuple[str, torch.Tensor, bool]]] = {}
    owner: dict[str, tuple[int, str]] = {}  # wire name -> (group, model name)
    named: list[tuple[str, torch.Tensor, bool]] = [
        (n, t, True) for n, t in model.named_parameters(remove_duplicate=False)
    ]
    named += [(n, t, False) for n, t in model.named_buffers(remove_duplicate=False)]
    for name, tensor, is_param in named:
        wire = wire_name(name)
        key = id(tensor)
        if wire in owner and owner[wire][0] != key:
            raise ValueError(
                f"{owner[wire][1]!r} and {name!r} both become {wire!r} once the wrapper prefixes "
                "are taken out"
            )
        if wire in owner:
            continue  # the same tensor reached through a second path of the same name
        owner[wire] = (key, name)
        groups.setdefault(key, []).append((wire, tensor, is_param))
    return {group[0][0]: group for group in groups.values()}


def load_into(model: torch.nn.Module, path: str | Path, *, strict: bool = True) -> LoadReport:
    """Copy a checkpoint's parameters into ``model`` (wrapped or not) in place.

    ``path``: a checkpoint folder, its ``params.safetensors``, a save dir (its newest
    checkpoint) or any safetensors file. Names match without wrapper prefixes; a tied tensor
    takes the value saved under any of its names. With ``strict`` (the default), a model
    parameter the file lacks or a name in the file the model lacks is a ``ValueError`` listing
    them, raised before anything is copied; a shape that differs always is."""
    tensors = read_params(path)
    plan: list[tuple[torch.Tensor, torch.Tensor]] = []
    loaded: list[str] = []
    tied: dict[str, str] = {}
    missing: list[str] = []
    known: set[str] = set()
    for group in _model_tensors(model).values():
        names = [wire for wire, _, _ in group]
        known.update(names)
        found = [n for n in names if n in tensors]
        if not found:
            if any(is_param for _, _, is_param in group):
                missing.append(names[0])
            continue
        source = tensors[found[0]]
        target = group[0][1]
        for other in found[1:]:
            if not torch.equal(tensors[other], source):
                raise ValueError(
                    f"{found[0]!r} and {other!r} are one tied tensor in the model but hold "
                    "different values in the file"
                )
        if tuple(source.shape) != tuple(target.shape):
            raise ValueError(
                f"{found[0]!r} has shape {tuple(source.shape)} in the file and "
                f"{tuple(target.shape)} in the model"
            )
        plan.append((target, source))
        loaded += names
        tied.update({n: found[0] for n in names if n not in tensors})
    unexpected = sorted(set(tensors) - known)
    if strict and (missing or unexpected):
        raise ValueError(
            f"{checkpoint_file(path)} does not fit the model: "
            f"missing from the file {_few(missing)}, not in the model {_few(unexpected)}"
        )
    with torch.no_grad():
        for target, source in plan:
            target.copy_(source)
    return LoadReport(loaded, tied, missing, unexpected)


def _few(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit]) or "none"
    return f"[{shown}{f', ... ({len(names)} in all)' if len(names) > limit else ''}]"


# --- export -------------------------------------------------------------------------------------


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
            f"not in the checkpoint {_few(missing)}, not in the folder {_few(unexpected)}"
        )
    return out


def export_like(checkpoint: str | Path, like: str | Path, out: str | Path) -> Path:
    """Write ``out``, a model folder like ``like`` (the folder a run began from with
    ``--init``) holding the checkpoint's parameters: the original's other files (config,
    tokenizer) copied, its weights replaced by one ``model.safetensors`` under the original names
    and dtypes, which ``from_pretrained`` opens. Built in a temporary folder beside ``out`` and
    renamed into place, so ``out`` is either absent or complete."""
    like, out = Path(like), Path(out)
    if not like.is_dir():
        raise ValueError(f"--like must be a model folder: {like}")
    if out.exists():
        raise ValueError(f"{out} exists; export writes a new folder")
    original, metadata = _original(like)
    tensors = exported_tensors(read_params(checkpoint), original)
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
    log.info("exported %s as %s (%d tensors)", checkpoint_file(checkpoint), out, len(tensors))
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
        "a checkpoint folder (round-N), its params.safetensors, or a save dir (its newest)",
        metavar="PATH",
    )
    """The checkpoint to export (``checkpoint_file`` says which paths are accepted)."""

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
