"""The low-rank codec (PowerSGD with warm start) and error feedback: hand-checked properties,
the invariant ``sum sent + residual == sum of pseudo-gradients``, state across a rejoin."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load, save

from diloco.core.codecs import (
    Bf16Codec,
    BlockCodec,
    Codec,
    CodecError,
    ErrorFeedback,
    Fp4Codec,
    Fp32Codec,
    Int4Codec,
    Int8Codec,
    LowRankCodec,
)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


# --- low rank --------------------------------------------------------------------------------


def test_lowrank_parts_and_fallback_by_shape() -> None:
    codec = LowRankCodec(rank=4)
    assert [(p.suffix, p.shape) for p in codec.parts((300, 200))] == [
        ("", (300, 4)),
        ("@q", (200, 4)),
    ]
    assert codec.nbytes((300, 200)) == 4 * 4 * 500
    # conv weights are (out, in * kh * kw)
    assert codec.matrix_shape((16, 8, 3, 3)) == (16, 72)
    # vectors, and matrices whose factors would not be smaller, take the fallback (int8)
    assert codec.matrix_shape((64,)) is None
    assert codec.matrix_shape((8, 8)) is None  # 4 * 16 >= 64
    assert codec.parts((64,)) == Int8Codec().parts((64,))
    x = torch.randn(8, 8)
    assert all(
        torch.equal(a, b) for a, b in zip(codec.encode(x, "w"), Int8Codec().encode(x), strict=True)
    )


def test_lowrank_is_exact_on_a_rank_one_matrix() -> None:
    u, v = torch.randn(50, 1), torch.randn(1, 40)
    m = u @ v
    codec = LowRankCodec(rank=2)
    p, q = codec.encode(m, "w")
    torch.testing.assert_close(p.t() @ p, torch.eye(2))  # orthonormal P
    torch.testing.assert_close(codec.decode([p, q], m.shape), m)


def test_lowrank_warm_start_uses_the_previous_q() -> None:
    g = torch.Generator().manual_seed(0)
    # decaying spectrum: the top-2 subspace is found by repeated power iterations
    basis_l, _ = torch.linalg.qr(torch.randn(120, 120, generator=g))
    basis_r, _ = torch.linalg.qr(torch.randn(80, 80, generator=g))
    sv = torch.tensor([10.0, 6.0] + [0.9**k for k in range(78)])
    m = basis_l[:, :80] * sv @ basis_r.t()
    best = torch.linalg.svdvals(m)[2:].norm() / m.norm()  # the rank-2 optimum
    codec = LowRankCodec(rank=2)
    errors = []
    for _ in range(6):
        parts = codec.encode(m, "w")
        # the state is the Q just sent: the next round starts from it
        assert torch.equal(codec.state_dict()["w"], parts[1])
        errors.append(_rel(codec.decode(parts, m.shape), m))
    assert all(b <= a + 1e-6 for a, b in zip(errors, errors[1:], strict=False)), errors
    assert errors[0] > errors[-1] and errors[-1] < best * 1.01
    # a fresh codec starts again from the seeded Gaussian Q: the first round's error
    assert _rel(
        LowRankCodec(rank=2).decode(LowRankCodec(rank=2).encode(m, "w"), m.shape), m
    ) == pytest.approx(errors[0])


def test_lowrank_state_survives_a_rejoin() -> None:
    m = torch.randn(60, 50)
    a = LowRankCodec(rank=3)
    a.encode(m, "w")
    b = LowRankCodec(rank=3)
    b.load_state_dict(load(save(a.state_dict())))
    assert all(torch.equal(x, y) for x, y in zip(a.encode(m, "w"), b.encode(m, "w"), strict=True))
    with pytest.raises(ValueError, match="expected"):
        LowRankCodec(rank=4).load_state_dict(a.state_dict())


def test_lowrank_check() -> None:
    codec = LowRankCodec(rank=2)
    p, q = codec.encode(torch.randn(30, 20), "w")
    codec.check([p, q], (30, 20))
    for bad in (float("nan"), float("inf"), 1e20):
        q2 = q.clone()
        q2[3, 1] = bad
        with pytest.raises(CodecError) as e:
            codec.check([p, q2], (30, 20))
        assert e.value.code == "non_finite"
    with pytest.raises(CodecError) as e:
        codec.check([p, q[:-1]], (30, 20))
    assert e.value.code == "bad_shape"


def test_lowrank_initial_q_depends_on_seed_and_name_only() -> None:
    m = torch.randn(40, 30)
    first = LowRankCodec(rank=2).encode(m, "a")
    assert torch.equal(first[0], LowRankCodec(rank=2).encode(m, "a")[0])
    assert not torch.equal(first[0], LowRankCodec(rank=2).encode(m, "b")[0])
    assert not torch.equal(first[0], LowRankCodec(rank=2, seed=1).encode(m, "a")[0])


# --- error feedback --------------------------------------------------------------------------

FEEDBACK_CODECS: list[Codec] = [
    Int8Codec(),
    Int4Codec(),
    Fp4Codec(),
    Bf16Codec(),
    LowRankCodec(rank=2),
]


@pytest.mark.parametrize("codec", FEEDBACK_CODECS, ids=repr)
def test_sent_plus_residual_is_the_sum_of_pseudo_gradients(codec: Codec) -> None:
    g = torch.Generator().manual_seed(5)
    shapes = {"w": (40, 30), "b": (30,)}
    feedback = ErrorFeedback()
    true_sum = {k: torch.zeros(s) for k, s in shapes.items()}
    sent_sum = {k: torch.zeros(s) for k, s in shapes.items()}
    for _ in range(6):
        for name, shape in shapes.items():
            pg = torch.randn(shape, generator=g) * 1e-2
            parts = feedback.encode(codec, name, pg)
            sent_sum[name] += codec.decode(parts, shape)
            true_sum[name] += pg
    for name in shapes:
        torch.testing.assert_close(sent_sum[name] + feedback.residuals[name], true_sum[name])
    assert feedback.norm() > 0


@pytest.mark.parametrize("codec", [Int8Codec(), Int4Codec()], ids=repr)
def test_feedback_by_pieces_equals_whole_tensors(codec: BlockCodec) -> None:
    n = 3 * codec.align + 100
    whole, pieces = ErrorFeedback(), ErrorFeedback()
    g = torch.Generator().manual_seed(2)
    for _ in range(3):
        pg = torch.randn(n, generator=g)
        parts = whole.encode(codec, "w", pg)
        got = [
            pieces.encode_piece(codec, "w", (n,), a, pg[a : a + codec.align])
            for a in range(0, n, codec.align)
        ]
        for i, part in enumerate(parts):
            assert torch.equal(part, torch.cat([p[i] for p in got]))
        assert torch.equal(whole.residuals["w"], pieces.residuals["w"])
    with pytest.raises(ValueError, match="multiple"):
        pieces.encode_piece(codec, "w", (n,), 7, pg[7:100])


def test_feedback_is_nothing_for_a_lossless_codec() -> None:
    feedback = ErrorFeedback()
    pg = torch.randn(100)
    (sent,) = feedback.encode(Fp32Codec(), "w", pg)
    assert torch.equal(sent, pg) and torch.count_nonzero(feedback.residuals["w"]) == 0


def test_residual_carries_what_was_dropped_by_hand() -> None:
    codec = Int8Codec(block=4)
    feedback = ErrorFeedback()
    # scale 127/8 / 127 = 0.125; 0.3 -> code 2 (0.25): 0.05 is owed
    pg = torch.tensor([0.3, 0.0, 0.0, 15.875])
    codec_parts = feedback.encode(codec, "w", pg)
    assert codec_parts[1].tolist() == [2, 0, 0, 127]
    torch.testing.assert_close(feedback.residuals["w"], torch.tensor([0.05, 0.0, 0.0, 0.0]))
    # next round 0.3 + 0.05 = 0.35 -> code 3 (0.375): -0.025 owed
    feedback.encode(codec, "w", pg)
    torch.testing.assert_close(feedback.residuals["w"], torch.tensor([-0.025, 0.0, 0.0, 0.0]))


def test_feedback_state_round_trip_through_safetensors() -> None:
    codec = Int4Codec()
    a = ErrorFeedback()
    g = torch.Generator().manual_seed(9)
    pgs = [torch.randn(20, 30, generator=g) for _ in range(2)]
    a.encode(codec, "layer.weight", pgs[0])
    b = ErrorFeedback()
    b.load_state_dict(load(save(a.state_dict())))
    assert torch.equal(a.residuals["layer.weight"], b.residuals["layer.weight"])
    assert all(
        torch.equal(x, y)
        for x, y in zip(
            a.encode(codec, "layer.weight", pgs[1]),
            b.encode(codec, "layer.weight", pgs[1]),
            strict=True,
        )
    )
    a.forget("layer.weight")
    assert a.norm() == 0.0 and b.norm() > 0
