"""The initial parameters of a test server and the type of the fixture that starts servers."""

from __future__ import annotations

from collections.abc import Callable

import torch

from diloco.server.server import DiLoCoServer


def initial_params() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(3, 4, generator=g), "b": torch.randn(4, generator=g)}


ServerFactory = Callable[..., DiLoCoServer]
