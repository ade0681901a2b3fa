"""The swarm tests' small model and data for ``diloco swarm-peer`` processes:

    diloco swarm-peer --model tests.programs.swarm_model:build_stage \
        --data tests.programs.swarm_model:batches ...

``build_stage(k, S)`` is stage ``k`` of the data plane's 4-layer MLP (``tests/helpers/swarm.py``,
seed 0); ``batches()`` yields its batches of 16, seeded."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from diloco.swarm import stage_of
from tests.helpers.swarm import batches as make_batches
from tests.helpers.swarm import make_model


def build_stage(k: int, num_stages: int) -> nn.Module:
    return stage_of(make_model, k, num_stages)


def batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    yield from make_batches(64, 16)
