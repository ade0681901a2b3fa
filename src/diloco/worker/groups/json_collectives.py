"""Small JSON values between the ranks of a worker group, as bytes in tensor collectives.

``torch.distributed``'s object collectives (the ``*_object*`` functions)
pickle their values, and a worker group's ranks may sit on different machines: nothing that
crosses a network is unpickled in this project. These send the value's JSON as a ``uint8``
tensor instead, with its length first, through the plain tensor collectives of the group (gloo
on CPU, NCCL on CUDA: ``device`` is where the group's tensors must live).

Values are what JSON holds: dicts with string keys, lists, strings, numbers, booleans, None.
Tuples come back as lists, so callers convert what they need (``WorkerGroup`` its tables).
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist


def _encode(value: Any, device: torch.device) -> torch.Tensor:
    data = json.dumps(value, separators=(",", ":")).encode()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)


def _decode(t: torch.Tensor) -> Any:
    return json.loads(bytes(t.cpu().numpy().tobytes()).decode())


def broadcast_json(value: Any, pg: Any, *, src: bool, device: torch.device) -> Any:
    """Every rank gets the value of the group's rank 0 (``src`` True there; other ranks pass
    anything, e.g. None). A collective: every rank of ``pg`` calls it at the same point."""
    if src:
        payload = _encode(value, device)
        size = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    else:
        size = torch.zeros(1, dtype=torch.int64, device=device)
    dist.broadcast(size, group_src=0, group=pg)
    if not src:
        payload = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    if payload.numel():
        dist.broadcast(payload, group_src=0, group=pg)
    return value if src else _decode(payload)


def all_gather_json(value: Any, pg: Any, *, device: torch.device) -> list[Any]:
    """Every rank's value, in rank order, on every rank (a collective)."""
    world = dist.get_world_size(pg)
    payload = _encode(value, device)
    size = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(sizes, size, group=pg)
    lengths = [int(s.item()) for s in sizes]
    width = max(lengths)
    padded = torch.zeros(width, dtype=torch.uint8, device=device)
    padded[: payload.numel()] = payload
    gathered = [torch.empty(width, dtype=torch.uint8, device=device) for _ in range(world)]
    dist.all_gather(gathered, padded, group=pg)
    return [_decode(g[:n]) for g, n in zip(gathered, lengths, strict=True)]
