"""A run's parameters back into the user's model: ``load_into``.

A checkpoint holds the global parameters under their wire names (``diloco.core.names``): no
wrapper prefixes, and each tied tensor once, under the name ``named_parameters()`` keeps (GPT-2's
``transformer.wte.weight``, not ``lm_head.weight``). So ``load_state_dict`` of a checkpoint fails
on a wrapped model or a tied one; ``load_into`` matches names without prefixes and gives every
name of a tied tensor the value saved under any one of them.

The model may be sharded: parameters that are DTensors (FSDP2's ``fully_shard``, tensor
parallelism, both on a 2-D mesh) take, on each rank, exactly the elements that rank holds
(``diloco.core.local_box``), read from the file lazily, so every rank calls ``load_into``, no
collective runs and no rank reads more than one parameter's box at a time. The file is read
tensor by tensor for plain models too: at most one tensor of it is in memory beside the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from diloco.core.local_box import LocalBox, local_box
from diloco.core.names import wire_name, wire_names

PARAMS_FILE = "params.safetensors"  # a checkpoint folder's parameters (diloco.persistence)
# Tied values are compared in blocks of about this many bytes, so a check never holds a whole
# (possibly huge) embedding on a rank that only holds a shard of it.
COMPARE_BYTES = 64 << 20


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


@dataclass(frozen=True)
class _Copy:
    """One planned copy: the file's tensor ``key``, the part of it ``box``, into ``local``."""

    key: str
    box: LocalBox
    local: torch.Tensor


def load_into(model: torch.nn.Module, path: str | Path, *, strict: bool = True) -> LoadReport:
    """Copy a checkpoint's parameters into ``model`` (wrapped, tied or sharded) in place.

    ``path``: a checkpoint folder, its ``params.safetensors``, a save dir (its newest
    checkpoint) or any safetensors file. Names match without wrapper prefixes; a tied tensor
    takes the value saved under any of its names. With ``strict`` (the default), a model
    parameter the file lacks or a name in the file the model lacks is a ``ValueError`` listing
    them, raised before anything is copied; a shape that differs (from the global shape, for a
    DTensor) always is, and so is a DTensor with a ``Partial`` placement.

    A model whose parameters are DTensors: every rank of its mesh calls ``load_into``; each
    copies into its local tensor the elements it holds, read alone from the file. No collective
    runs, and every rank raises the same errors, since they depend on the file and the global
    layout only."""
    file = checkpoint_file(path)
    try:
        fh = safe_open(str(file), framework="pt")
    except Exception as exc:  # safetensors raises its own error types for torn files
        raise ValueError(f"{file}: unreadable tensors: {exc}") from None
    with fh:
        plan, report = _plan(model, fh)
        if strict and (report.missing or report.unexpected):
            raise ValueError(
                f"{file} does not fit the model: missing from the file "
                f"{few_names(report.missing)}, not in the model {few_names(report.unexpected)}"
            )
        with torch.no_grad():
            for copy in plan:
                block = fh.get_slice(copy.key)[copy.box.bounds()]
                copy.local.copy_(copy.box.take(block))
    return report


def _plan(model: torch.nn.Module, fh: Any) -> tuple[list[_Copy], LoadReport]:
    """What ``load_into`` will copy from the open file ``fh``, from its header and the model
    alone (tied values aside, compared in blocks); a ``ValueError`` for a shape that differs,
    tied names with different values, or a DTensor this rank cannot take its part of."""
    stored = wire_names((key, key) for key in fh.keys())  # wire name -> the file's key
    plan: list[_Copy] = []
    report = LoadReport([], {}, [], [])
    known: set[str] = set()
    for group in _model_tensors(model).values():
        names = [wire for wire, _, _ in group]
        known.update(names)
        found = [n for n in names if n in stored]
        if not found:
            if any(is_param for _, _, is_param in group):
                report.missing.append(names[0])
            continue
        target = group[0][1]
        shape = tuple(fh.get_slice(stored[found[0]]).get_shape())
        if shape != tuple(target.shape):
            raise ValueError(
                f"{found[0]!r} has shape {shape} in the file and {tuple(target.shape)} in the model"
            )
        for other in found[1:]:
            if not _same_in_file(fh, stored[found[0]], stored[other]):
                raise ValueError(
                    f"{found[0]!r} and {other!r} are one tied tensor in the model but hold "
                    "different values in the file"
                )
        plan.append(_Copy(stored[found[0]], *_local_part(found[0], target)))
        report.loaded.extend(names)
        report.tied.update({n: found[0] for n in names if n not in stored})
    report.unexpected.extend(sorted(set(stored) - known))
    return plan, report


def _local_part(name: str, tensor: torch.Tensor) -> tuple[LocalBox, torch.Tensor]:
    """The elements of the global tensor this rank holds of ``tensor``, and the tensor that
    holds them here: all of a plain tensor; a DTensor's box, by its placements, and its local
    tensor (``to_local()`` shares the parameter's storage, so copying into it loads it)."""
    dtensor = _as_dtensor(tensor)
    if dtensor is None:
        return LocalBox.whole(tensor.shape), tensor
    mesh = dtensor.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise ValueError(f"{name!r}: this rank is not in the parameter's device mesh")
    try:
        box = local_box(dtensor.shape, mesh.shape, coordinate, dtensor.placements)
    except ValueError as exc:
        raise ValueError(f"{name!r} is a DTensor that cannot be loaded: {exc}") from None
    with torch.no_grad():  # a view made with grad enabled could not be copied into
        local = dtensor.to_local()
    if box.shape != tuple(local.shape):  # a layout torch has and core.local_box does not know
        raise ValueError(
            f"{name!r}: placements {dtensor.placements} give this rank a shard of shape "
            f"{box.shape}, but it holds {tuple(local.shape)}"
        )
    return box, local


def _as_dtensor(tensor: torch.Tensor) -> Any:
    """``tensor`` if it is a DTensor, else None (also where torch has no distributed
    support, so a plain model loads on any build)."""
    if not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor

    return tensor if isinstance(tensor, DTensor) else None


def _same_in_file(fh: Any, a: str, b: str) -> bool:
    """Whether the file's tensors ``a`` and ``b`` (of one shape) are equal, read in blocks of
    the first dimension of about ``COMPARE_BYTES``."""
    x, y = fh.get_slice(a), fh.get_slice(b)
    shape = x.get_shape()
    if shape != y.get_shape():
        return False
    if not shape:
        return bool(torch.equal(x[()], y[()]))
    row_bytes = max(1, torch.Size(shape[1:]).numel() * 8)  # 8: the widest dtype, a bound
    step = max(1, COMPARE_BYTES // row_bytes)
    return all(
        torch.equal(x[i : i + step], y[i : i + step]) for i in range(0, max(shape[0], 1), step)
    )


def few_names(names: list[str], limit: int = 8) -> str:
    """Up to ``limit`` of ``names`` and how many there are in all, for an error message."""
    shown = ", ".join(names[:limit]) or "none"
    return f"[{shown}{f', ... ({len(names)} in all)' if len(names) > limit else ''}]"
