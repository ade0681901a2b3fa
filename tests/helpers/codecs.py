"""Codec uploads: the shapes, pseudo-gradients and models the codec tests share, a body with
each tensor's parts in a chosen order, and waiting for the server to show a state."""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from diloco import DiLoCoWorker
from diloco.server.server import DiLoCoServer
from tests.helpers.http import (
    TIMEOUT,
)

SHAPES = {"w": (64, 48), "b": (48,), "e": (5000,)}  # a matrix for low rank, odd-length vectors


def model() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}


def grads(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + seed)
    return {n: torch.randn(s, generator=g) * 1e-2 for n, s in SHAPES.items()}


def wait_status(server: DiLoCoServer, done: Callable[[dict[str, Any]], bool]) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not done(st := server.status()):
        assert time.monotonic() < deadline, st
        time.sleep(0.005)


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(40, 30), torch.nn.Linear(30, 5))


def worker(**kw: object) -> DiLoCoWorker:
    model = make_model()
    return DiLoCoWorker(model, torch.optim.SGD(model.parameters(), lr=0.1), "127.0.0.1:1", **kw)  # type: ignore[arg-type]


_DTYPES = {
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.uint16: "U16",
    torch.bfloat16: "BF16",
    torch.float32: "F32",
}


def in_order(tensors: Mapping[str, torch.Tensor], meta: Mapping[str, str]) -> bytes:
    """A safetensors body with the tensors in the given order (``wire.encode`` sorts them by
    width): each tensor's parts together, as the protocol lays them out."""
    header: dict[str, Any] = {"__metadata__": dict(meta)}
    raw, pos = [], 0
    for name, t in tensors.items():
        data = t.contiguous().view(torch.uint8).numpy().tobytes()
        header[name] = {
            "dtype": _DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [pos, pos + len(data)],
        }
        raw.append(data)
        pos += len(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + b"".join(raw)
