"""``persistence.lazy_tensors``: a safetensors file written one tensor at a time reads back as
``save_file``'s would (what a sharded group's rank 0 writes its all-reduce checkpoint with)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from diloco.persistence import load_checkpoint, save_checkpoint
from diloco.persistence.lazy_tensors import LazyTensors, write_lazy


def _tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return {
        "a.weight": torch.randn(3, 5, generator=gen),
        "empty": torch.empty(0),
        "b": torch.randn(7, generator=gen).to(torch.bfloat16),
        "scalar": torch.tensor(2.5),
    }


def _lazy(tensors: dict[str, torch.Tensor], reads: list[str]) -> LazyTensors:
    def fetch(name: str) -> torch.Tensor:
        reads.append(name)
        return tensors[name].clone()

    return LazyTensors({n: (t.dtype, tuple(t.shape)) for n, t in tensors.items()}, fetch)


def test_a_lazy_file_reads_back_as_the_tensors_each_read_once(tmp_path: Path) -> None:
    tensors, reads = _tensors(), []
    write_lazy(_lazy(tensors, reads), tmp_path / "t.safetensors")
    assert reads == list(tensors)
    got = load_file(str(tmp_path / "t.safetensors"))
    assert set(got) == set(tensors)
    for name, t in tensors.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name


def test_a_fetched_tensor_unlike_its_spec_is_refused(tmp_path: Path) -> None:
    lazy = LazyTensors({"x": (torch.float32, (2,))}, lambda n: torch.zeros(3))
    with pytest.raises(ValueError, match=r"x: fetched torch.float32\(3,\), its spec says"):
        write_lazy(lazy, tmp_path / "t.safetensors")


def test_a_checkpoint_of_lazy_params_and_momentum_loads(tmp_path: Path) -> None:
    params = {"w": torch.randn(4, 2), "b": torch.randn(4)}
    momentum = {"0/momentum_buffer": torch.randn(4, 2), "1/momentum_buffer": torch.randn(4)}
    state = {"state": {}, "param_groups": [{"lr": 0.7, "momentum": 0.9, "params": [0, 1]}]}
    path = save_checkpoint(
        tmp_path,
        3,
        _lazy(params, []),
        state,
        {"param_order": ["w", "b"]},
        2,
        optimizer_tensors=_lazy(momentum, []),
    )
    ckpt = load_checkpoint(path)
    assert ckpt.round == 3
    for name, t in params.items():
        assert torch.equal(ckpt.params[name], t)
    loaded = ckpt.optimizer_state["state"]
    assert torch.equal(loaded[0]["momentum_buffer"], momentum["0/momentum_buffer"])
    assert torch.equal(loaded[1]["momentum_buffer"], momentum["1/momentum_buffer"])
