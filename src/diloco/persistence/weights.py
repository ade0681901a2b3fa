"""A user's model weights from a file or a model folder: safetensors, or a PyTorch state dict.
The server's initial parameters (``--init PATH``, and what ``--output-dir`` finds in its
folder) and ``diloco export --like``'s original tensors are read here.

Accepted:
- a ``.safetensors`` file, or a folder holding some (a Hugging Face model folder): every such
  file at its top level;
- a state dict file (``.pt``, ``.pth``, ``.bin``), or a folder holding none of the above but
  ``pytorch_model.bin`` (or its shards ``pytorch_model-*.bin``), or exactly one state dict file.

A state dict is read by ``torch.load(weights_only=True)``, the restricted unpickler that builds
tensors and plain containers only: a file that would run code or build other objects is refused
by it, and nothing else is ever unpickled. What it holds must be a dict of names to tensors; a
checkpoint that wraps one (``{"model": {...}, "epoch": 3}``) is unwrapped when exactly one of
its values is such a dict, and refused, naming its keys, when several are. Tensors that share
storage (tied weights, which ``state_dict()`` lists under each name) are kept once, under their
first name, as ``named_parameters()`` and safetensors files list them.

A name present in two files is an error rather than a silent choice.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

log = logging.getLogger(__name__)

STATE_DICT_SUFFIXES = (".pt", ".pth", ".bin")
"""File names a PyTorch state dict is read from."""


def weight_files(folder: Path) -> list[Path]:
    """The files of ``folder`` that hold its model's weights (see the module docstring); empty
    when it holds none. Several candidate state dict files and no ``pytorch_model*.bin`` is a
    ValueError: a folder of training leftovers (``optimizer.pt``, ``training_args.bin``) must
    not be guessed from."""
    found = sorted(folder.glob("*.safetensors"))
    if found:
        return found
    hf = sorted(folder.glob("pytorch_model.bin")) or sorted(folder.glob("pytorch_model-*.bin"))
    if hf:
        return hf
    candidates = sorted(p for p in folder.iterdir() if p.is_file() and _is_state_dict_name(p))
    if len(candidates) > 1:
        names = ", ".join(p.name for p in candidates)
        raise ValueError(
            f"{folder} holds several state dict files ({names}) and no .safetensors or "
            "pytorch_model.bin: name the one to start from with --init FILE"
        )
    return candidates


def read_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a weights file, or of the weight files of a folder (see the module
    docstring); a ValueError naming the file for anything else."""
    path = Path(path)
    if path.is_dir():
        files = weight_files(path)
        if not files:
            raise ValueError(
                f"no .safetensors or PyTorch state dict file ({', '.join(STATE_DICT_SUFFIXES)}) "
                f"in {path}"
            )
    elif path.is_file():
        files = [path]
    else:
        raise ValueError(f"initial parameters not found: {path}")
    out: dict[str, torch.Tensor] = {}
    for file in files:
        for name, tensor in _read(file).items():
            if name in out:
                raise ValueError(f"tensor {name!r} appears in more than one file under {path}")
            out[name] = tensor
    return out


def _is_state_dict_name(path: Path) -> bool:
    return path.suffix in STATE_DICT_SUFFIXES


def _read(file: Path) -> dict[str, torch.Tensor]:
    if not _is_state_dict_name(file):
        return load_file(str(file))  # safetensors (any other name is tried as one)
    return read_state_dict(file)


def read_state_dict(file: Path) -> dict[str, torch.Tensor]:
    """The tensors of a PyTorch state dict file, through the restricted loader only."""
    try:
        loaded = torch.load(file, weights_only=True, map_location="cpu")
    except Exception as exc:  # the loader's refusals: UnpicklingError, RuntimeError, EOFError...
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(
            f"{file}: not a PyTorch state dict that torch.load(weights_only=True) reads "
            f"(only tensors in plain containers are loaded, never other objects): {first}"
        ) from None
    return _dedupe_tied(file, _unwrap(file, loaded))


def _unwrap(file: Path, loaded: Any) -> dict[str, torch.Tensor]:
    """``loaded`` as a flat dict of names to tensors, or a ValueError saying what it is."""
    if not isinstance(loaded, dict):
        raise ValueError(
            f"{file}: holds a {type(loaded).__name__}, not a state dict (a dict of parameter "
            "names to tensors)"
        )
    if not loaded:
        raise ValueError(f"{file}: holds an empty dict, no tensor")
    if all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in loaded.items()):
        return loaded
    nested = [k for k, v in loaded.items() if _is_flat_state_dict(v)]
    tensors = [k for k, v in loaded.items() if isinstance(v, torch.Tensor)]
    if len(nested) == 1 and not tensors:
        log.warning("%s: using the state dict under key %r (the file's only one)", file, nested[0])
        return dict(loaded[nested[0]])
    if len(nested) > 1:
        keys = ", ".join(repr(k) for k in nested)
        raise ValueError(
            f"{file}: holds several state dicts (under {keys}); save the one to start from "
            f"on its own, e.g. torch.save(checkpoint[{nested[0]!r}], 'model.pt')"
        )
    odd = next((k, v) for k, v in loaded.items() if not isinstance(v, torch.Tensor))
    raise ValueError(
        f"{file}: not a flat state dict of parameter names to tensors: key {odd[0]!r} holds "
        f"a {type(odd[1]).__name__}"
    )


def _is_flat_state_dict(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and bool(value)
        and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in value.items())
    )


def _dedupe_tied(file: Path, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each tensor once: a tied weight appears in ``state_dict()`` under every name it has,
    but a model's parameters (what workers register) list it once, under its first name."""
    seen: dict[tuple[int, int, tuple[int, ...], tuple[int, ...]], str] = {}
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        key = (t.untyped_storage().data_ptr(), int(t.storage_offset()), tuple(t.shape), t.stride())
        if t.numel() and key in seen:
            log.info("%s: %s is tied to %s; kept once, as %s", file, name, seen[key], seen[key])
            continue
        seen.setdefault(key, name)
        out[name] = t
    return out
