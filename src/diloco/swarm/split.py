"""Splitting an ``nn.Sequential`` into pipeline stages that keep the unsplit model's names.

A stage is the contiguous run of layers ``[start, stop)`` of the sequence. Its
``named_parameters()`` are the unsplit model's (``"3.weight"``, not ``"0.weight"``), so the stage
tables the coordinator checks, and the checkpoints each stage writes, join back into one model
with no renaming. The split balances parameter count, the one figure known before anything runs;
throughput-balanced splits need measurements and are left to the caller's own ``build_stage``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import nn


class Stage(nn.Module):
    """Layers ``start..stop-1`` of a sequence, applied in order, registered under their index
    in the unsplit sequence (so parameter names are the unsplit model's)."""

    def __init__(self, layers: dict[int, nn.Module]) -> None:
        super().__init__()
        if not layers:
            raise ValueError("a stage needs at least one layer")
        for index, layer in sorted(layers.items()):
            self.add_module(str(index), layer)
        self.indices = sorted(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.children():
            x = layer(x)
        return x

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self.children())


def _param_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def stage_bounds(sizes: list[int], num_stages: int) -> list[tuple[int, int]]:
    """Contiguous ``[start, stop)`` ranges of ``len(sizes)`` layers, one per stage, each with at
    least one layer, minimizing the largest stage's total of ``sizes`` (among equal splits, the one
    the search meets first: deterministic). Exact by dynamic programming: sequences are short (tens of layers)."""
    n = len(sizes)
    if not 1 <= num_stages <= n:
        raise ValueError(f"cannot split {n} layers into {num_stages} stages of at least one layer")
    prefix = [0]
    for s in sizes:
        prefix.append(prefix[-1] + s)
    inf = float("inf")
    # best[k][i]: the least possible largest stage putting the first i layers into k stages.
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0
    for k in range(1, num_stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    bounds, i = [], n
    for k in range(num_stages, 0, -1):
        j = cut[k][i]
        bounds.append((j, i))
        i = j
    return bounds[::-1]


def split_sequential(model: nn.Sequential, num_stages: int) -> list[nn.Module]:
    """``num_stages`` stages of ``model``, contiguous, balanced by parameter count (every stage
    has at least one layer). The stages share the model's layer objects (no copy): training a
    stage trains the model. A ``ValueError`` when ``model`` has fewer layers than stages."""
    if not isinstance(model, nn.Sequential):
        raise ValueError(f"split_sequential needs an nn.Sequential, got {type(model).__name__}")
    layers = list(model)
    bounds = stage_bounds([_param_count(m) for m in layers], num_stages)
    return [Stage({i: layers[i] for i in range(a, b)}) for a, b in bounds]


def stage_of(factory: Callable[[], nn.Sequential], k: int, num_stages: int) -> nn.Module:
    """Stage ``k`` of ``num_stages`` of the model ``factory()`` builds: a ``build_stage(k, S)``
    for demos and tests. It materializes the WHOLE model once and keeps one stage, so it is no
    way to train a model too large for one machine; a real ``build_stage`` builds only its own
    layers (with the unsplit model's names)."""
    if not 0 <= k < num_stages:
        raise ValueError(f"stage {k} is not one of 0..{num_stages - 1}")
    return split_sequential(factory(), num_stages)[k]
