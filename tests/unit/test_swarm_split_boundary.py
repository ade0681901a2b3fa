"""Pure parts of the swarm's data plane (issue 29): splitting a sequence into stages, and the
boundary codecs' round trips, shape checks and bytes per token."""

from __future__ import annotations

from collections.abc import Mapping

import pytest
import torch
from torch import nn

from diloco.swarm import BoundaryCodec, BoundarySpec, split_sequential, stage_of
from diloco.swarm.split import stage_bounds


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 16), nn.Linear(16, 2)
    )


def test_stage_bounds_minimize_the_largest_stage() -> None:
    # No split of 10 0 10 0 10 10 into three stages keeps every stage under 20.
    assert stage_bounds([10, 0, 10, 0, 10, 10], 3) == [(0, 1), (1, 3), (3, 6)]
    assert stage_bounds([1, 1, 1, 9], 2) == [(0, 3), (3, 4)]
    assert stage_bounds([5, 5], 2) == [(0, 1), (1, 2)]
    assert stage_bounds([0, 0, 0], 3) == [(0, 1), (1, 2), (2, 3)]  # one layer each at least
    with pytest.raises(ValueError, match="3 layers into 4 stages"):
        stage_bounds([1, 1, 1], 4)


def test_split_keeps_names_and_composes_to_the_model() -> None:
    model = _model()
    stages = split_sequential(model, 3)
    names = [n for s in stages for n, _ in s.named_parameters()]
    assert names == [n for n, _ in model.named_parameters()]
    x = torch.randn(5, 4)
    a = x
    for s in stages:
        a = s(a)
    assert torch.equal(a, model(x))
    # The stages share the model's layers: a checkpoint of the stages is the model's.
    joined = {n: p for s in stages for n, p in s.state_dict().items()}
    assert joined.keys() == model.state_dict().keys()
    assert all(joined[n].data_ptr() == p.data_ptr() for n, p in model.state_dict().items())
    with pytest.raises(ValueError, match="nn.Sequential"):
        split_sequential(nn.Linear(2, 2), 1)  # type: ignore[arg-type]


def test_stage_of_builds_one_stage_with_the_model_names() -> None:
    stage = stage_of(_model, 1, 3)
    want = dict(split_sequential(_model(), 3)[1].named_parameters())
    got = dict(stage.named_parameters())
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)
    with pytest.raises(ValueError, match="stage 3"):
        stage_of(_model, 3, 3)


SPEC = BoundarySpec("0->1", (16, 64))


def test_fp32_round_trip_is_exact_and_extras_travel() -> None:
    t = torch.randn(4, 16, 64)
    y = torch.randint(0, 5, (4, 16))
    got, extras = BoundaryCodec(SPEC, "fp32").decode(
        BoundaryCodec(SPEC, "fp32").encode(t, {"targets": y}), ("targets",)
    )
    assert torch.equal(got, t) and torch.equal(extras["targets"], y)


@pytest.mark.parametrize(("codec", "per_token", "rel"), [
    ("bf16", 2 * 64, 0.01),
    ("int8", 64 + 2, 0.01),  # codes, one bf16 scale per row (block = hidden)
    ("int4", 64 // 2 + 2, 0.15),
])  # fmt: skip
def test_lossy_codecs_bytes_per_token_and_error(codec: str, per_token: int, rel: float) -> None:
    c = BoundaryCodec(SPEC, codec)
    assert c._core is not None
    assert c._core.nbytes((4, 16, 64)) == 4 * 16 * per_token
    t = torch.randn(4, 16, 64)
    got, _ = c.decode(c.encode(t))
    assert got.shape == t.shape and got.dtype == torch.float32
    assert (got - t).norm() / t.norm() < rel


def test_a_row_that_is_no_power_of_two_uses_the_default_block() -> None:
    spec = BoundarySpec("b", (48,))
    c = BoundaryCodec(spec, "int8")
    assert c._core is not None and c._core.options() == {"block": "64"}
    t = torch.randn(3, 48)
    got, _ = c.decode(c.encode(t))
    assert (got - t).norm() / t.norm() < 0.01


def test_a_wrong_shape_names_the_boundary_and_both_shapes() -> None:
    other = BoundaryCodec(BoundarySpec("0->1", (16, 65)), "fp32").encode(torch.randn(2, 16, 65))
    with pytest.raises(
        ValueError, match=r"boundary 0->1: expected shape \[batch, 16, 64\].*\[2, 16, 65\]"
    ):
        BoundaryCodec(SPEC, "fp32").decode(other)
    with pytest.raises(ValueError, match="boundary 0->1"):
        BoundaryCodec(SPEC, "fp32").encode(torch.randn(2, 64))
    with pytest.raises(ValueError, match="expected codec int8, got 'fp32'"):
        BoundaryCodec(SPEC, "int8").decode(
            BoundaryCodec(SPEC, "fp32").encode(torch.randn(1, 16, 64))
        )
    with pytest.raises(ValueError, match="malformed body"):
        BoundaryCodec(SPEC, "fp32").decode(b"\x00" * 12)
    with pytest.raises(ValueError, match="lacks targets"):
        BoundaryCodec(SPEC, "fp32").decode(
            BoundaryCodec(SPEC, "fp32").encode(torch.randn(1, 16, 64)), ("targets",)
        )
    with pytest.raises(ValueError, match="not one of"):
        BoundaryCodec(SPEC, "lowrank")


class _Project:
    """A model's own compression: a fixed projection onto 8 of 64 directions."""

    def __init__(self) -> None:
        self.basis = torch.linalg.qr(
            torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
        )[0]

    def encode(self, t: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"coeffs": t @ self.basis}

    def decode(self, parts: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return parts["coeffs"] @ self.basis.T


def test_a_model_may_supply_its_own_compression() -> None:
    c = BoundaryCodec(SPEC, compressor=_Project())
    inside = torch.randn(2, 16, 8) @ c.compressor.basis.T  # type: ignore[union-attr]
    body = c.encode(inside)
    assert len(body) < 2 * 16 * 8 * 4 + 300
    got, _ = c.decode(body)
    torch.testing.assert_close(got, inside)
    with pytest.raises(ValueError, match="expected codec custom"):
        c.decode(BoundaryCodec(SPEC, "fp32").encode(inside))
