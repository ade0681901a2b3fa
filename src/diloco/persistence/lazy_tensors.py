"""Tensors a checkpoint writes one at a time: ``LazyTensors`` (each tensor's dtype and shape
known up front, its values produced when read) and ``write_lazy``, a safetensors file written
tensor by tensor, so the writer never holds more than one of them. A sharded worker group's
rank 0 saves the run's state this way in all-reduce mode: its parameters and momentum are on
the group's shards and are gathered one parameter at a time."""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch

_CODES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int64: "I64"}


class LazyTensors(Mapping[str, torch.Tensor]):
    """``specs`` (name -> dtype and shape, in file order) whose values ``fetch(name)`` makes
    when read; a value may be a buffer that is valid only until the next read."""

    def __init__(
        self,
        specs: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
        fetch: Callable[[str], torch.Tensor],
    ) -> None:
        self.specs = dict(specs)
        self._fetch = fetch

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.specs:
            raise KeyError(name)
        return self._fetch(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.specs)

    def __len__(self) -> int:
        return len(self.specs)


def write_lazy(tensors: LazyTensors, path: Path) -> None:
    """A safetensors file of ``tensors`` in their order (the format: an 8-byte little-endian
    header length, the JSON header padded with spaces to 8 bytes, then the bytes of each
    tensor at its ``data_offsets``), reading each tensor once. Raises ValueError when a
    fetched tensor is not the dtype and shape its spec says."""
    header: dict[str, object] = {}
    offset = 0
    for name, (dtype, shape) in tensors.specs.items():
        size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        header[name] = {
            "dtype": _CODES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name, (dtype, shape) in tensors.specs.items():
            t = tensors[name]
            if t.dtype != dtype or tuple(t.shape) != tuple(shape):
                raise ValueError(
                    f"{name}: fetched {t.dtype}{tuple(t.shape)}, its spec says {dtype}{shape}"
                )
            f.write(t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().data)
