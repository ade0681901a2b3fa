"""Initial parameters from a safetensors file or a folder of them (a Hugging Face model folder)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file


def load_initial_params(path: str | Path) -> dict[str, torch.Tensor]:
    """Floating-point tensors of a ``.safetensors`` file, or of every such file in a folder.

    Integer tensors (position ids, masks) are not parameters and are skipped. A name present in
    two files is an error rather than a silent choice."""
    path = Path(path)
    if path.is_dir():
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise ValueError(f"no .safetensors file in {path}")
    elif path.is_file():
        files = [path]
    else:
        raise ValueError(f"initial parameters not found: {path}")
    out: dict[str, torch.Tensor] = {}
    for file in files:
        for name, tensor in load_file(str(file)).items():
            if not tensor.is_floating_point():
                continue
            if name in out:
                raise ValueError(f"tensor {name!r} appears in more than one file under {path}")
            out[name] = tensor
    if not out:
        raise ValueError(f"no floating-point tensor in {path}")
    return out
