"""A sharded group's download on rank 0 (``worker/groups/sharded_model.py``): the client's
reads land in one parameter's staging buffer at a time, each parameter is handed on (``put``)
once its last byte is in, and no staging buffer is ever larger than the largest parameter."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch

from diloco.core.shards import Box
from diloco.wire import TensorSpec, WireError, build_layout, byte_view
from diloco.wire.decode import readinto_payload
from diloco.worker.groups.shard_table import ShardPlan
from diloco.worker.groups.sharded import ShardState, Staging
from diloco.worker.groups.sharded_model import _Window

SHAPES = {"a": (5, 4), "empty": (0,), "b": (3,), "c": (16, 6)}


def _state(monkeypatch: pytest.MonkeyPatch, puts: list[tuple[str, torch.Tensor]]) -> ShardState:
    """Rank 0's state without a process group: ``put`` records what the staging holds."""
    state = ShardState.__new__(ShardState)
    state.rank = 0
    state.staging = Staging(torch.device("cpu"))
    state.plans = {
        n: ShardPlan(n, s, "torch.float32", ((Box((0,) * len(s), s), True), None))
        for n, s in SHAPES.items()
    }

    def command(cmd: dict[str, Any]) -> None:
        assert cmd["cmd"] == "put"
        puts.append((cmd["name"], state.staged(state.plans[cmd["name"]]).clone()))

    monkeypatch.setattr(state, "command", command)
    return state


def _download(
    state: ShardState, values: dict[str, torch.Tensor], read_bytes: int, cut: int | None = None
) -> None:
    """One download body (its first ``cut`` bytes only: it breaks off) through a window."""
    layout = build_layout([TensorSpec(n, "F32", s) for n, s in SHAPES.items()])
    body = io.BytesIO(b"".join(bytes(byte_view(values[s.name])) for s in layout.specs)[:cut])

    def readinto(view: memoryview) -> int:  # short reads, cut anywhere
        return body.readinto(view[:read_bytes])

    dest: Any = _Window(layout, state)
    readinto_payload(readinto, body.read, dest)
    dest.finish()


@pytest.mark.parametrize("read_bytes", [1, 7, 64, 1 << 20])
def test_each_parameter_is_put_whole_once_its_bytes_are_in(
    monkeypatch: pytest.MonkeyPatch, read_bytes: int
) -> None:
    torch.manual_seed(0)
    values = {n: torch.randn(s) for n, s in SHAPES.items()}
    puts: list[tuple[str, torch.Tensor]] = []
    state = _state(monkeypatch, puts)
    _download(state, values, read_bytes)
    assert [n for n, _ in puts] == ["a", "empty", "b", "c"]  # layout order, each once
    for name, got in puts:
        assert torch.equal(got, values[name]), name
    # One parameter's staging, reused: the largest parameter, never the model.
    assert state.staging.sizes() == {"whole:cpu": 16 * 6 * 4}


def test_a_retried_download_starts_again_from_its_first_byte(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    puts: list[tuple[str, torch.Tensor]] = []
    state = _state(monkeypatch, puts)
    first = {n: torch.zeros(s) for n, s in SHAPES.items()}
    second = {n: torch.ones(s) for n, s in SHAPES.items()}
    with pytest.raises(WireError, match="body ended"):
        _download(state, first, 5, cut=100)  # a (80 bytes) and b (12) are in, c is not
    assert [n for n, _ in puts] == ["a", "empty", "b"]
    _download(state, second, 5)  # the retry: a new window from the first byte
    assert [n for n, _ in puts[3:]] == ["a", "empty", "b", "c"]
    assert all(torch.equal(t, second[n]) for n, t in puts[3:])
