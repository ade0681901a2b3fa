"""Initial parameters from a weights file or a model folder (``--init``, ``--output-dir``):
safetensors, or a PyTorch state dict through the restricted loader
(``diloco.persistence.weights``)."""

from __future__ import annotations

from pathlib import Path

import torch

from diloco.persistence.weights import read_weights


def load_initial_params(path: str | Path) -> dict[str, torch.Tensor]:
    """Floating-point tensors of a weights file, or of a folder's weight files. Integer tensors
    (position ids, masks) are not parameters and are skipped."""
    out = {n: t for n, t in read_weights(path).items() if t.is_floating_point()}
    if not out:
        raise ValueError(f"no floating-point tensor in {path}")
    return out
