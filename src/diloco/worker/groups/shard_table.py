"""The agreement of a sharded worker group (docs/design/groups.md, "Sharded groups"): what each
rank says about its DTensor parameters, and the check every rank runs on what all of them said.

Each rank describes every parameter: a plain tensor, or a DTensor's mesh (the global ranks in
its shape), placements and what this rank holds of it (its mesh coordinate and local shape).
Nothing here raises on one rank alone: a placement this worker cannot sync becomes an
``error`` in the description, so that every rank, checking the same gathered descriptions,
raises the same ``ValueError`` naming the rank and the difference before anything is sent.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from diloco.core.shards import Box, local_box, owns, placement_code, tiles_once

Description = dict[str, Any]
"""One rank's description of one parameter, as JSON: ``{"plain": true}``, or ``mesh`` (global
ranks, nested as the mesh), ``placements`` (codes), ``coord``, ``local`` (its shape), and
``error`` for a placement that cannot be synced."""


@dataclass(frozen=True)
class ShardPlan:
    """One parameter of a sharded group, as every rank agreed on it."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    #: Per group rank: the box it holds and whether it owns it; None where it holds nothing
    #: of this parameter for DiLoCo (a plain parameter off rank 0: rank 0's copy is sent and
    #: broadcast back, as in a replicated group).
    boxes: tuple[tuple[Box, bool] | None, ...]

    @property
    def plain(self) -> bool:
        """A plain tensor (every rank holds it whole): rank 0 alone handles it."""
        return all(b is None for b in self.boxes[1:])

    @property
    def width(self) -> int:
        """The elements of the largest box: the padded size of every rank's part in a gather
        or scatter of this parameter."""
        return max((b.numel for b, _ in filter(None, self.boxes)), default=0)


def is_dtensor(p: torch.Tensor) -> bool:
    return type(p).__name__ == "DTensor" or type(p.data).__name__ == "DTensor"


def local_part(p: torch.Tensor) -> torch.Tensor:
    """What this rank holds of a parameter (its DTensor's local shard, else the tensor)."""
    data = p.data
    return data.to_local() if is_dtensor(data) else data  # type: ignore[attr-defined]


def describe(params: Mapping[str, torch.Tensor]) -> dict[str, Description]:
    """This rank's description of each parameter (never raises: see the module's docstring)."""
    out: dict[str, Description] = {}
    for name, p in params.items():
        data = p.data
        if not is_dtensor(data):
            out[name] = {"plain": True}
            continue
        mesh = data.device_mesh  # type: ignore[attr-defined]
        entry: Description = {
            "mesh": mesh.mesh.tolist(),
            "mesh_shape": list(mesh.shape),
            "coord": list(mesh.get_coordinate() or []),
            "local": list(data.to_local().shape),  # type: ignore[attr-defined]
        }
        try:
            entry["placements"] = [placement_code(name, pl) for pl in data.placements]  # type: ignore[attr-defined]
        except ValueError as exc:
            entry["error"] = str(exc)
        out[name] = entry
    return out


def refuse_unsupported(first: Mapping[str, Any]) -> None:
    """Refuse what a sharded group does not sync yet (rank 0's settings: every rank raises)."""
    if first["partitioned"]:
        raise ValueError(
            "worker group: partitioned=True with sharded (DTensor) parameters; a sharded group "
            "syncs each parameter from its shards: leave partitioned unset"
        )
    if first["codec"] not in ("fp32", "bf16") and first["num_fragments"] > 1:
        raise ValueError(
            f"worker group: codec {first['codec']!r} with streaming fragments "
            f"(num_fragments={first['num_fragments']}) is not supported with sharded (DTensor) "
            "parameters yet; a sharded group streams fp32 or bf16 (codec=None, bf16_comm), or "
            "sends a lossy codec with num_fragments=1"
        )


def agree_on_shards(
    descriptions: Sequence[Mapping[str, Description]],
    tables: Sequence[Mapping[str, tuple[tuple[int, ...], str]]],
    group_ranks: Sequence[int],
) -> dict[str, ShardPlan]:
    """Check what every rank described and return the plan of every parameter; the same
    ``ValueError`` on every rank for any difference. ``tables``: each rank's name -> (global
    shape, dtype), already checked equal; ``group_ranks``: the group's global ranks in group
    order."""
    plans: dict[str, ShardPlan] = {}
    for name, (shape, dtype) in tables[0].items():
        first = descriptions[0][name]
        for r, desc in enumerate(descriptions):
            if "error" in desc[name]:
                raise ValueError(f"worker group: rank {r}: {desc[name]['error']}")
            if desc[name].get("plain", False) != first.get("plain", False):
                kinds = [
                    "a plain tensor" if d.get("plain") else "a DTensor" for d in (desc[name], first)
                ]
                raise ValueError(
                    f"worker group: rank {r} holds parameter {name!r} as {kinds[0]}, rank 0 as "
                    f"{kinds[1]}"
                )
            for key in ("mesh", "placements"):
                if desc[name].get(key) != first.get(key):
                    raise ValueError(
                        f"worker group: rank {r} has parameter {name!r} with {key} "
                        f"{desc[name].get(key)}, rank 0 with {first.get(key)}"
                    )
        if first.get("plain"):
            whole = Box((0,) * len(shape), shape)
            boxes: list[tuple[Box, bool] | None] = [(whole, True)] + [None] * (len(tables) - 1)
        else:
            boxes = list(_sharded_boxes(name, shape, descriptions, group_ranks))
        plans[name] = ShardPlan(name, shape, dtype, tuple(boxes))
    return plans


def _sharded_boxes(
    name: str,
    shape: tuple[int, ...],
    descriptions: Sequence[Mapping[str, Description]],
    group_ranks: Sequence[int],
) -> list[tuple[Box, bool]]:
    first = descriptions[0][name]
    mesh_shape, placements = first["mesh_shape"], first["placements"]
    positions = _positions(first["mesh"], mesh_shape)
    if sorted(positions) != sorted(group_ranks):
        raise ValueError(
            f"worker group: parameter {name!r} lies on a device mesh of global ranks "
            f"{sorted(positions)}, the worker group is global ranks {sorted(group_ranks)}: "
            "build the mesh over the group's ranks"
        )
    out = []
    for r, desc in enumerate(descriptions):
        coord = positions[group_ranks[r]]
        box = local_box(shape, mesh_shape, placements, coord)
        got = desc[name]
        if list(got["coord"]) != list(coord) or tuple(got["local"]) != box.shape:
            raise ValueError(
                f"worker group: rank {r} holds {tuple(got['local'])} of parameter {name!r} at "
                f"mesh coordinate {tuple(got['coord'])}; its placements {placements} give "
                f"{box.shape} at {coord}"
            )
        out.append((box, owns(placements, coord)))
    if not tiles_once(shape, [b for b, own in out if own]):
        raise ValueError(
            f"worker group: the shards of parameter {name!r} do not cover it exactly once"
        )
    return out


def _positions(mesh: Any, mesh_shape: Sequence[int]) -> dict[int, tuple[int, ...]]:
    """Global rank -> its coordinate in the nested list ``mesh``."""
    out: dict[int, tuple[int, ...]] = {}

    def walk(node: Any, at: tuple[int, ...]) -> None:
        if len(at) == len(mesh_shape):
            out[int(node)] = at
            return
        for i, child in enumerate(node):
            walk(child, (*at, i))

    walk(mesh, ())
    return out
