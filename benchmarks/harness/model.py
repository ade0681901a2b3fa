"""The process-level benchmarks' model: a stack of square bias-free ``nn.Linear`` layers.

Its size is set by a parameter count (``choose_shape``), every process builds the same
parameters from one seed (so all-reduce workers start from one state and no broadcast happens),
and a round's local training is stood in for by ``perturb``: a small change to every weight,
drawn through a 4 MB noise buffer so that it barely shows in a worker's RSS. torch is imported
inside the functions: a parent that never imports it keeps its spawned children's
fork-before-exec copy small.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

from benchmarks.harness.processes import run_child
from benchmarks.harness.report import fmt_mb


@dataclass(frozen=True)
class ModelShape:
    dim: int
    layers: int

    @property
    def numel(self) -> int:
        return self.dim * self.dim * self.layers

    @property
    def nbytes(self) -> int:
        return 4 * self.numel

    def record(self) -> dict[str, int]:
        """The model as a results file records it."""
        return {"dim": self.dim, "layers": self.layers, "numel": self.numel}

    def describe(self) -> str:
        """The model as a run's heading names it."""
        return (
            f"{self.layers} x Linear({self.dim}, {self.dim}, bias=False) = "
            f"{self.numel:,} params, {fmt_mb(self.nbytes)} MB fp32"
        )


def choose_shape(params: float, max_dim: int) -> ModelShape:
    """Square layers: at most ``max_dim`` wide, at least 4 layers when the model allows it."""
    dim = max(8, min(max_dim, int(math.sqrt(params / 4))))
    layers = max(1, round(params / (dim * dim)))
    return ModelShape(dim, layers)


def width_shape(params: float, dim: int = 1024) -> ModelShape:
    """Layers of a fixed width ``dim``: about ``params`` parameters, at least one layer (the
    links and utilization benchmarks' model)."""
    return ModelShape(dim, max(1, round(params / (dim * dim))))


def build_model(shape: ModelShape, seed: int = 0) -> Any:
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(
        *[torch.nn.Linear(shape.dim, shape.dim, bias=False) for _ in range(shape.layers)]
    )


def write_params_main(path: str, shape: ModelShape) -> None:
    """A child: the model's initial parameters as a safetensors file (so no worker uploads them)."""
    import torch
    from safetensors.torch import save_file

    torch.set_num_threads(1)
    model = build_model(shape)
    save_file({n: p.detach().contiguous() for n, p in model.named_parameters()}, path)


def write_params(ctx: Any, folder: str, shape: ModelShape, timeout: float) -> str:
    """``write_params_main`` run in a child of ``ctx`` (the parent never imports torch), writing
    into ``folder``: the file's path."""
    path = os.path.join(folder, "init.safetensors")
    run_child(ctx, write_params_main, (path, shape), timeout, "writing the initial parameters")
    return path


def noise_buffer(shape: ModelShape) -> Any:
    """The scratch ``perturb`` draws into: at most 2**20 elements (4 MB)."""
    import torch

    return torch.empty(min(shape.dim * shape.dim, 1 << 20))


def perturb(model: Any, noise: Any, gen: Any) -> None:
    """Stand-in for H local steps: a small change (sd 1e-3) to every weight, in place."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            flat = p.view(-1)
            for start in range(0, flat.numel(), noise.numel()):
                part = flat[start : start + noise.numel()]
                noise.normal_(0.0, 1e-3, generator=gen)
                part.add_(noise[: part.numel()])


def checksum(model: Any) -> float:
    """fp32 sums of the parameters (a float64 sum would allocate a float64 copy of each tensor):
    the same bytes give the same sum, so equal sums say that processes hold the same parameters."""
    import torch

    with torch.no_grad():
        return sum(float(p.sum()) for p in model.parameters())
