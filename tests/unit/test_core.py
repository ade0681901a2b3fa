"""Core maths against values computed by hand."""

from __future__ import annotations

import pytest
import torch

from diloco.core import (
    WeightedSum,
    adopt_,
    apply_outer_step,
    default_outer_optimizer,
    optimizer_hparams,
    pseudo_gradient,
    rebase_,
    set_optimizer_hparams,
    to_progress_,
)


def test_pseudo_gradient_is_global_minus_local() -> None:
    g = torch.tensor([1.0, 2.0, -3.0])
    local = torch.tensor([0.5, 2.5, -3.0])
    assert pseudo_gradient(g, local, torch.float32).tolist() == [0.5, -0.5, 0.0]


def test_pseudo_gradient_rounds_to_bf16_after_subtracting() -> None:
    # 1000.0 and 1000.0 + 2**-4 are both exactly representable in fp32 but not distinct in bf16;
    # subtracting first keeps the step 0.0625 exactly.
    g = torch.tensor([1000.0 + 2**-4])
    local = torch.tensor([1000.0])
    pg = pseudo_gradient(g, local, torch.bfloat16)
    assert pg.dtype == torch.bfloat16
    assert pg.item() == 0.0625
    # Rounding each side to bf16 first would have lost it entirely.
    assert (g.bfloat16() - local.bfloat16()).item() == 0.0


def test_progress_rebase_and_adopt() -> None:
    local = torch.tensor([3.0, 5.0])
    old_global = torch.tensor([1.0, 1.0])
    to_progress_(local, old_global)
    assert local.tolist() == [2.0, 4.0]
    rebase_(local, torch.tensor([10.0, 20.0]))
    assert local.tolist() == [12.0, 24.0]
    adopt_(local, torch.tensor([7.0, 8.0]))
    assert local.tolist() == [7.0, 8.0]


def test_weighted_sum_mean() -> None:
    acc = WeightedSum([(2,)])
    acc.add([torch.tensor([1.0, 3.0])], weight=1.0)
    acc.add([torch.tensor([4.0, 0.0], dtype=torch.bfloat16)], weight=3.0)
    # (1*[1,3] + 3*[4,0]) / 4 = [13/4, 3/4]
    (mean,) = acc.mean_()
    assert mean.tolist() == [3.25, 0.75]
    assert acc.count == 2
    acc.reset()
    assert acc.count == 0 and acc.total_weight == 0.0
    # The next round starts from nothing: the stale sums are overwritten, not added to.
    acc.add([torch.tensor([2.0, 1.0], dtype=torch.bfloat16)], weight=0.5)
    acc.add([torch.tensor([1.0, 1.0])], weight=1.0)
    assert acc.sums[0].tolist() == [2.0, 1.5] and acc.total_weight == 1.5


@pytest.mark.parametrize("weight", [1.0, 0.3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_first_contribution_after_reset_is_bitwise_an_add_to_zeros(
    weight: float, dtype: torch.dtype
) -> None:
    g = torch.randn(1000, generator=torch.Generator().manual_seed(3)).to(dtype)
    fresh = WeightedSum([(1000,)])
    fresh.add([g], weight)
    reused = WeightedSum([(1000,)])
    reused.add([torch.full((1000,), 7.0, dtype=dtype)], 2.0)
    reused.reset()
    reused.add([g], weight)
    want = torch.zeros(1000).add_(g.float(), alpha=weight)
    assert torch.equal(fresh.sums[0], want) and torch.equal(reused.sums[0], want)


def test_weighted_sum_rejects_bad_input() -> None:
    acc = WeightedSum([(1,)])
    with pytest.raises(ValueError):
        acc.add([torch.zeros(1)], weight=0.0)
    with pytest.raises(ValueError):
        acc.add([torch.zeros(1), torch.zeros(1)], weight=1.0)
    with pytest.raises(ValueError):
        acc.mean_()


def test_weighted_sum_in_a_given_order_reports_each_piece(monkeypatch: pytest.MonkeyPatch) -> None:
    import diloco.core.accumulate as acc_mod

    monkeypatch.setattr(acc_mod, "CHUNK", 4)  # pieces of 4 elements: 10 -> 4, 4, 2
    shapes = [(2, 5), (3,)]
    a = torch.arange(10, dtype=torch.float32).view(2, 5)
    b = torch.tensor([1.0, -2.0, 0.5], dtype=torch.bfloat16)
    reports: list[tuple[int, int]] = []
    acc = acc_mod.WeightedSum(shapes)
    acc.add([a, b], 2.0, order=[1, 0], on_piece=lambda i, end: reports.append((i, end)))
    # Tensor 1 first (one piece of 3), then tensor 0 in pieces ending at 4, 8 and 10.
    assert reports == [(1, 3), (0, 4), (0, 8), (0, 10)]
    assert acc.sums[0].tolist() == (2 * a).tolist()
    assert acc.sums[1].tolist() == [2.0, -4.0, 1.0]
    # A second contribution adds (it no longer overwrites); the order does not change sums.
    acc.add([a, b], 1.0)
    assert acc.sums[1].tolist() == [3.0, -6.0, 1.5] and acc.total_weight == 3.0


def test_weighted_sum_refuses_a_bad_order_or_shape_before_changing_anything() -> None:
    acc = WeightedSum([(2,), (1,)])
    acc.add([torch.tensor([1.0, 2.0]), torch.tensor([3.0])], 1.0)
    before = [s.clone() for s in acc.sums]
    with pytest.raises(ValueError, match="order"):
        acc.add([torch.tensor([1.0, 1.0]), torch.tensor([1.0])], 1.0, order=[0, 0])
    with pytest.raises(ValueError, match="shape"):
        # The first tensor is fine and the second is not: nothing at all is added.
        acc.add([torch.tensor([5.0, 5.0]), torch.tensor([1.0, 2.0])], 1.0)
    assert all(torch.equal(s, b) for s, b in zip(acc.sums, before, strict=True))
    assert acc.count == 1 and acc.total_weight == 1.0


def test_default_outer_optimizer_is_nesterov_sgd_by_hand() -> None:
    p = torch.nn.Parameter(torch.tensor([1.0]), requires_grad=False)
    opt = default_outer_optimizer([p], lr=0.5, momentum=0.9, nesterov=True)
    # step 1: b = g = 2; update = g + m*b = 2 + 1.8 = 3.8; p = 1 - 0.5*3.8 = -0.9
    apply_outer_step(opt, [p], [torch.tensor([2.0])])
    assert p.item() == pytest.approx(-0.9)
    assert p.grad is None
    # step 2: b = 0.9*2 + 1 = 2.8; update = 1 + 0.9*2.8 = 3.52; p = -0.9 - 1.76 = -2.66
    apply_outer_step(opt, [p], [torch.tensor([1.0])])
    assert p.item() == pytest.approx(-2.66)


def test_outer_step_with_plain_sgd_lr_one_is_averaging() -> None:
    # lr 1, no momentum: the new global is exactly the mean of the workers' local params.
    p = torch.nn.Parameter(torch.tensor([4.0, 4.0]), requires_grad=False)
    opt = default_outer_optimizer([p], lr=1.0, momentum=0.0)
    locals_ = [torch.tensor([2.0, 6.0]), torch.tensor([3.0, 3.0])]
    mean_pg = sum(p.detach() - local for local in locals_) / 2
    apply_outer_step(opt, [p], [mean_pg])
    assert p.tolist() == [2.5, 4.5]


def test_outer_step_skips_parameters_without_gradient() -> None:
    a = torch.nn.Parameter(torch.tensor([1.0]), requires_grad=False)
    b = torch.nn.Parameter(torch.tensor([1.0]), requires_grad=False)
    opt = default_outer_optimizer([a, b], lr=1.0, momentum=0.9)
    apply_outer_step(opt, [a], [torch.tensor([0.5])])
    assert a.item() == pytest.approx(1.0 - (0.5 + 0.9 * 0.5))
    assert b.item() == 1.0
    assert b not in opt.state or "momentum_buffer" not in opt.state[b]


def test_hparams_read_and_set() -> None:
    p = torch.nn.Parameter(torch.zeros(1))
    opt = default_outer_optimizer([p])
    assert optimizer_hparams(opt) == {"lr": 0.7, "momentum": 0.9}
    set_optimizer_hparams(opt, lr=0.3, momentum=0.5)
    assert optimizer_hparams(opt) == {"lr": 0.3, "momentum": 0.5}
    adam = torch.optim.Adam([p])
    with pytest.raises(ValueError):
        set_optimizer_hparams(adam, momentum=0.5)


@pytest.mark.parametrize("nesterov", [True, False])
def test_outer_sgd_matches_torch_sgd(nesterov: bool) -> None:
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(5, 3), requires_grad=False)
    b = torch.nn.Parameter(a.detach().clone(), requires_grad=False)
    ours = default_outer_optimizer([a], lr=0.7, momentum=0.9, nesterov=nesterov)
    ref = torch.optim.SGD([b], lr=0.7, momentum=0.9, nesterov=nesterov)
    for _ in range(4):
        g = torch.randn(5, 3)
        apply_outer_step(ours, [a], [g.clone()])
        apply_outer_step(ref, [b], [g.clone()])
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(ours.state[a]["momentum_buffer"], ref.state[b]["momentum_buffer"])


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_outer_sgd_divisor_equals_stepping_on_the_mean(
    monkeypatch: pytest.MonkeyPatch, nesterov: bool, momentum: float
) -> None:
    """The fused, piecewise update (pieces of 7 elements here, so tensors end in a ragged piece)
    with ``divisor`` gives the bits that dividing the sum first and stepping whole tensors give."""
    import diloco.core.outer as outer_mod

    monkeypatch.setattr(outer_mod, "PIECE", 7)
    nesterov = nesterov and momentum > 0  # torch refuses Nesterov without momentum
    gen = torch.Generator().manual_seed(4)
    start = [torch.randn(5, 4, generator=gen), torch.randn(3, generator=gen)]
    ours = [torch.nn.Parameter(t.clone(), requires_grad=False) for t in start]
    ref = [torch.nn.Parameter(t.clone(), requires_grad=False) for t in start]
    opt = outer_mod.OuterSGD(ours, lr=0.7, momentum=momentum, nesterov=nesterov)
    ref_opt = torch.optim.SGD(ref, lr=0.7, momentum=momentum, nesterov=nesterov)
    for step in range(3):
        sums = [torch.randn(t.shape, generator=gen) for t in start]
        total = 3.0 + step  # not a power of two: division and multiplication round differently
        apply_outer_step(opt, ours, [s.clone() for s in sums], divisor=total)
        apply_outer_step(ref_opt, ref, [s / total for s in sums])
        for a, b in zip(ours, ref, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    if momentum:
        for a, b in zip(ours, ref, strict=True):
            torch.testing.assert_close(
                opt.state[a]["momentum_buffer"], ref_opt.state[b]["momentum_buffer"]
            )


def test_outer_sgd_steps_non_contiguous_gradients_whole() -> None:
    p = torch.nn.Parameter(torch.zeros(3, 2), requires_grad=False)
    q = torch.nn.Parameter(torch.zeros(3, 2), requires_grad=False)
    g = torch.arange(6, dtype=torch.float32).reshape(2, 3).t()  # a transposed view
    apply_outer_step(default_outer_optimizer([p]), [p], [g], divisor=2.0)
    apply_outer_step(torch.optim.SGD([q], lr=0.7, momentum=0.9, nesterov=True), [q], [g / 2])
    torch.testing.assert_close(p, q)


def test_outer_step_refuses_a_non_positive_divisor() -> None:
    p = torch.nn.Parameter(torch.zeros(1), requires_grad=False)
    with pytest.raises(ValueError):
        apply_outer_step(default_outer_optimizer([p]), [p], [torch.ones(1)], divisor=0.0)
    assert p.grad is None and p.item() == 0.0


def test_weighted_sum_converts_in_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    import diloco.core.accumulate as acc_mod

    monkeypatch.setattr(acc_mod, "CHUNK", 7)  # force several chunks and a ragged last one
    acc = acc_mod.WeightedSum([(5, 4)])
    t = torch.arange(20, dtype=torch.float32).reshape(5, 4)
    acc.add([t.bfloat16()], weight=2.0)
    torch.testing.assert_close(acc.sums[0], 2 * t)


@pytest.mark.parametrize("comm", [None, torch.bfloat16])
def test_pseudo_gradient_pieces_match_the_whole(comm: torch.dtype | None) -> None:
    from diloco.core import pseudo_gradient_pieces

    g = torch.randn(7, 5, generator=torch.Generator().manual_seed(1))
    local = g - torch.randn(7, 5, generator=torch.Generator().manual_seed(2))
    s32 = torch.empty(8)
    s16 = torch.empty(8, dtype=comm) if comm is not None else None
    pieces = [p.clone() for p in pseudo_gradient_pieces(g, local, s32, s16)]
    assert [p.numel() for p in pieces] == [8, 8, 8, 8, 3]
    expected = pseudo_gradient(g, local, comm or torch.float32).reshape(-1)
    assert torch.equal(torch.cat(pieces), expected)


def test_body_from_pieces_equals_body_from_tensor() -> None:
    from diloco.wire import build_layout, decode, iter_body
    from diloco.wire.layout import TensorSpec

    t = torch.arange(10, dtype=torch.float32)
    layout = build_layout([TensorSpec("t", "F32", (10,))])
    whole = b"".join(bytes(c) for c in iter_body(layout, lambda s: t))
    pieces = b"".join(bytes(c) for c in iter_body(layout, lambda s: iter([t[:4], t[4:]])))
    assert whole == pieces and torch.equal(decode(pieces)[1]["t"], t)
    with pytest.raises(ValueError, match="pieces of 't' hold 16 bytes"):
        b"".join(bytes(c) for c in iter_body(layout, lambda s: iter([t[:4]])))
