"""Streaming fragments on the server: a two-fragment plan and the test of which fragment a
parameter element belongs to."""

from __future__ import annotations

from typing import Any

import torch

FRAG2 = {"num_fragments": 2, "fragment_pattern": "sequential", "sync_every": 10}


def in_fragment(reply: dict[str, Any], k: int, name: str, shape: torch.Size) -> torch.Tensor:
    mask = torch.zeros(shape.numel(), dtype=torch.bool)
    for _, param, start, stop in reply["fragments"][k]:
        if param == name:
            mask[start:stop] = True
    return mask.view(shape)
