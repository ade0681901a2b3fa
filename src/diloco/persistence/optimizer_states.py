"""One optimizer state for several optimizers and back: the server's fragments each have their
own outer optimizer, and so do all-reduce mode's, yet a checkpoint holds one state (the
streaming layout).
"""

from __future__ import annotations

from typing import Any

import torch


def merge_states(
    optimizers: list[torch.optim.Optimizer],
) -> tuple[dict[str, Any], list[list[int]]]:
    """One state dict for the optimizers of all units (the server's fragments, or all-reduce mode's) (parameter indices offset, groups
    concatenated), and per unit [parameters, groups] to split it again."""
    state: dict[int, Any] = {}
    groups: list[dict[str, Any]] = []
    shape: list[list[int]] = []
    offset = 0
    for opt in optimizers:
        sd = opt.state_dict()
        count = sum(len(g["params"]) for g in sd["param_groups"])
        for idx, entry in sd["state"].items():
            state[int(idx) + offset] = entry
        for group in sd["param_groups"]:
            groups.append({**group, "params": [int(i) + offset for i in group["params"]]})
        shape.append([count, len(sd["param_groups"])])
        offset += count
    return {"state": state, "param_groups": groups}, shape


def split_states(merged: dict[str, Any], shape: list[list[int]] | None) -> list[dict[str, Any]]:
    """Inverse of ``merge_states``. No shape: a checkpoint of one optimizer."""
    if shape is None:
        return [merged]
    out = []
    p_off = g_off = 0
    for count, ngroups in shape:
        groups = [
            {**g, "params": [int(i) - p_off for i in g["params"]]}
            for g in merged["param_groups"][g_off : g_off + ngroups]
        ]
        state = {
            int(i) - p_off: v for i, v in merged["state"].items() if p_off <= int(i) < p_off + count
        }
        out.append({"state": state, "param_groups": groups})
        p_off += count
        g_off += ngroups
    return out
