"""A lossy codec's body in a sharded group (``worker/groups/sharded_codec.py``) against the plain
worker's (``UploadEncoder``'s ``_ModelBody``): the same bytes and the same residual, round after
round, and nothing moves without the commit. Rank 0's side alone: a ``ShardState`` whose
parameters are its own (plain plans), so every command runs here without a process group; the
gather and scatter across ranks are tests/processes/test_sharded_codec.py's."""

from __future__ import annotations

import pytest
import torch

from diloco.core.shards import Box
from diloco.worker.groups.shard_table import ShardPlan
from diloco.worker.groups.sharded import ShardState, Staging
from diloco.worker.groups.sharded_codec import ResidualShards
from diloco.worker.settings import parse_codec
from diloco.worker.state.encoder import Upload, UploadEncoder
from diloco.worker.state.local_model import LocalModel

SHAPES = {"w": (24, 20), "b": (37,), "s": ()}


def _model() -> torch.nn.Module:
    torch.manual_seed(3)
    m = torch.nn.Module()
    for name, shape in SHAPES.items():
        m.register_parameter(name, torch.nn.Parameter(torch.randn(shape)))
    return m


def _rank0(model: torch.nn.Module) -> ShardState:
    """Rank 0's shard state holding every parameter whole (no other rank holds any)."""
    params = dict(model.named_parameters())
    state = ShardState.__new__(ShardState)
    state.pg, state.rank, state.size = None, 0, 2
    state.device = torch.device("cpu")
    state._params = params
    state.plans = {
        n: ShardPlan(
            n, tuple(p.shape), "torch.float32", ((Box((0,) * p.dim(), p.shape), True), None)
        )
        for n, p in params.items()
    }
    state.snapshot = {n: p.detach().clone() for n, p in params.items()}
    state.residual = {}
    state.staging = Staging(torch.device("cpu"))
    state.handlers = {}
    return state


def _encoder(model: torch.nn.Module, codec: str, feedback: bool) -> UploadEncoder:
    local = LocalModel(model, "F32", {})
    local.snapshot = {n: p.detach().clone() for n, p in model.named_parameters()}
    return UploadEncoder(parse_codec(codec), local, {}, feedback)


def _body(up: Upload) -> list[torch.Tensor]:
    return [torch.as_tensor(up.produce(spec)).clone() for spec in up.specs]


def _step(models: list[torch.nn.Module], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, shape in SHAPES.items():
            step = torch.randn(shape, generator=g) * 0.01
            for m in models:
                getattr(m, name).sub_(step)


@pytest.mark.parametrize(
    "codec", ["int8", "int4", "lowrank:rank=2", "topk:density=0.1,chunk=64,bits=2"]
)
@pytest.mark.parametrize("feedback", [True, False], ids=["feedback", "no-feedback"])
def test_the_sharded_body_is_the_plain_workers(codec: str, feedback: bool) -> None:
    """Three rounds, the second upload refused (no commit): every round the same bytes, and
    after every commit the residual on the shards is the plain encoder's, bit for bit, its
    norm the metric; a refused upload moves nothing and its retry sends the same bytes."""
    plain_model, shard_model = _model(), _model()
    plain = _encoder(plain_model, codec, feedback)
    state = _rank0(shard_model)
    sharded = _encoder(shard_model, codec, feedback)
    sharded.model_body = ResidualShards(state).upload
    for rnd in range(3):
        _step([plain_model, shard_model], seed=rnd)
        up_plain, up_shard = plain.model_upload(), sharded.model_upload()
        assert up_plain.specs == up_shard.specs
        sent = _body(up_shard)
        for a, b in zip(_body(up_plain), sent, strict=True):
            assert torch.equal(a, b)
        before = {n: e.clone() for n, e in state.residual.items()}
        if rnd == 1:  # refused: nothing moves, and a retry is the same body
            assert {n: torch.equal(e, before[n]) for n, e in state.residual.items()} == {
                n: True for n in before
            }
            for a, b in zip(sent, _body(up_shard), strict=True):
                assert torch.equal(a, b)
            continue
        up_plain.commit()
        up_shard.commit()
        if not feedback:
            assert state.residual == {} and sharded.residual_norm() == 0.0
            continue
        assert set(state.residual) == set(SHAPES)
        for name, e in state.residual.items():
            want = plain.owed(name)
            assert want is not None and torch.equal(e, want), (rnd, name)
        assert sharded.residual_norm() == pytest.approx(plain.residual_norm(), rel=1e-6)
        assert sharded.residual_norm() > 0


def test_rank0_staging_is_a_few_parameters() -> None:
    """Rank 0 keeps no model-sized buffer: each staging buffer is at most the largest
    parameter (fp32), and none is left per parameter."""
    model = _model()
    state = _rank0(model)
    enc = _encoder(model, "int8", True)
    enc.model_body = ResidualShards(state).upload
    _step([model], seed=0)
    up = enc.model_upload()
    _body(up)
    up.commit()
    largest = 24 * 20 * 4
    assert max(state.staging.sizes().values()) <= largest
    assert len(state.staging.sizes()) <= 6
