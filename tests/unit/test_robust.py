"""core/robust.py and core/finite.py against hand-computed references."""

from __future__ import annotations

import math

import pytest
import torch

from diloco.core.delayed_nesterov import DelayedNesterov
from diloco.core.finite import FP32_MAX, FiniteGuard, max_abs, step_bounds
from diloco.core.outer import OuterSGD
from diloco.core.robust import CHUNK, clip_scales, global_norm, robust_mean, trim_count

# --- robust aggregation --------------------------------------------------------------------------


def test_clip_scales_relative_to_the_median() -> None:
    # median of 1, 2, 3, 100 is 2.5; factor 2 -> limit 5: only 100 is clipped, to 5/100.
    assert clip_scales([1.0, 2.0, 3.0, 100.0], 2.0) == [1.0, 1.0, 1.0, 0.05]
    # median 3.5, factor 1: 4 is scaled to 3.5 / 4.
    assert clip_scales([3.0, 4.0], 1.0) == [1.0, 0.875]
    # An infinite norm among finite ones is clipped to nothing.
    assert clip_scales([1.0, 1.0, math.inf], 3.0) == [1.0, 1.0, 0.0]
    assert clip_scales([], 2.0) == []
    with pytest.raises(ValueError):
        clip_scales([1.0], 0.0)


def test_global_norm_of_all_tensors_together() -> None:
    assert global_norm([torch.tensor([3.0]), torch.tensor([[4.0]]), torch.zeros(0)]) == 5.0
    assert global_norm([torch.tensor([3.0, 4.0], dtype=torch.bfloat16)]) == 5.0


def test_trim_count() -> None:
    assert trim_count(10, 0.2) == 2
    assert trim_count(5, 0.2) == 1
    assert trim_count(4, 0.2) == 0  # fewer than 1 / fraction: nothing trimmed
    assert trim_count(3, 0.49) == 1
    assert trim_count(2, 0.49) == 0  # never trims the last value away
    assert trim_count(7, 0.0) == 0
    with pytest.raises(ValueError):
        trim_count(4, 0.5)


def test_trimmed_mean_drops_the_extremes_of_each_coordinate() -> None:
    rows = [[1, 10, 0], [2, 20, 0], [3, 30, 0], [4, 40, 0], [100, -1000, 0]]
    uploads = [[torch.tensor(r, dtype=torch.float32)] for r in rows]
    out = [torch.full((3,), float("nan"))]
    result = robust_mean(uploads, [1.0] * 5, out, trim_fraction=0.2)
    # k = 1. Column 0: 1 2 3 4 100 -> mean(2, 3, 4) = 3; column 1: -1000 10 20 30 40 -> 20.
    assert result.trimmed == 1
    assert torch.equal(out[0], torch.tensor([3.0, 20.0, 0.0]))


def test_trimmed_mean_ignores_the_weights() -> None:
    uploads = [[torch.tensor([v])] for v in (1.0, 2.0, 3.0, 4.0, 5.0)]
    out = [torch.zeros(1)]
    robust_mean(uploads, [1.0, 1.0, 1.0, 1.0, 1e6], out, trim_fraction=0.2)
    assert out[0].item() == 3.0  # mean(2, 3, 4): the heavy 5 is trimmed like any other


def test_clipped_weighted_mean() -> None:
    # Norms 5, 1, 10; median 5, factor 1: the third is scaled by 1/2 to [3, 4].
    uploads = [
        [torch.tensor([3.0]), torch.tensor([4.0])],
        [torch.tensor([0.0]), torch.tensor([1.0])],
        [torch.tensor([6.0]), torch.tensor([8.0])],
    ]
    out = [torch.zeros(1), torch.zeros(1)]
    result = robust_mean(uploads, [1.0, 1.0, 2.0], out, clip_factor=1.0)
    assert result.norms == [5.0, 1.0, 10.0] and result.scales == [1.0, 1.0, 0.5]
    # (1 * [3, 4] + 1 * [0, 1] + 2 * [3, 4]) / 4 = [9, 13] / 4.
    assert out[0].item() == 2.25 and out[1].item() == 3.25


def test_clip_then_trim() -> None:
    # Norms 1, 2, 3, 4, 50 (median 3, factor 2 -> limit 6): -50 becomes -6; then k = 1 drops
    # -6 and 4: mean(1, 2, 3) = 2.
    uploads = [[torch.tensor([v])] for v in (1.0, 2.0, 3.0, 4.0, -50.0)]
    out = [torch.zeros(1)]
    result = robust_mean(uploads, [1.0] * 5, out, clip_factor=2.0, trim_fraction=0.2)
    assert result.scales[-1] == pytest.approx(6 / 50)
    assert out[0].item() == pytest.approx(2.0)


def test_trimmed_mean_in_chunks_matches_one_sort() -> None:
    g = torch.Generator().manual_seed(0)
    uploads = [[torch.randn(CHUNK * 2 + 7, generator=g)] for _ in range(6)]
    out = [torch.zeros(CHUNK * 2 + 7)]
    robust_mean(uploads, [1.0] * 6, out, trim_fraction=0.25)  # k = 1
    stacked = torch.stack([u[0] for u in uploads]).sort(dim=0).values
    torch.testing.assert_close(out[0], stacked[1:5].mean(dim=0), rtol=0, atol=0)


# --- finite outer steps --------------------------------------------------------------------------


def test_max_abs() -> None:
    assert max_abs([torch.tensor([-3.0, 2.0]), torch.tensor([1.0])]) == 3.0
    assert max_abs([torch.tensor([1.0, float("nan")])]) == math.inf
    assert max_abs([torch.tensor([-math.inf])]) == math.inf
    assert max_abs([torch.tensor([10**12]), torch.zeros(0)]) == 0.0  # integers are not looked at


def test_step_bounds() -> None:
    # s' = 0.9 * 2 + 3 = 4.8; p' = 1 + 0.5 * (4.8 + 2 + 3) = 5.9.
    p, s = step_bounds(1.0, 2.0, 3.0, 0.5, 0.9)
    assert s == pytest.approx(4.8) and p == pytest.approx(5.9)


def _param(values: list[float]) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.tensor(values), requires_grad=False)


def test_guard_applies_an_ordinary_step_without_a_copy() -> None:
    p = _param([1.0, 2.0])
    opt = OuterSGD([p], lr=1.0, momentum=0.0, nesterov=False)
    guard = FiniteGuard(opt, [p])
    done: list[int] = []
    why = guard.step([torch.tensor([2.0, 4.0])], divisor=2.0, on_piece=lambda _, n: done.append(n))
    assert why is None
    assert torch.equal(p.data, torch.tensor([0.0, 0.0]))  # p - sum / 2
    assert done == [2] and guard.checked_steps == 0
    assert guard.p_bound is not None and guard.p_bound >= 0.0


def test_guard_refuses_a_non_finite_mean_before_stepping() -> None:
    p = _param([1.0, 2.0])
    opt = OuterSGD([p], lr=0.7, momentum=0.9)
    guard = FiniteGuard(opt, [p])
    why = guard.step([torch.tensor([math.inf, 1.0])], divisor=2.0)
    assert why is not None and "not finite" in why
    assert torch.equal(p.data, torch.tensor([1.0, 2.0])) and p not in opt.state
    # A finite fp32 sum over a divisor that makes it overflow is refused too.
    assert guard.step([torch.tensor([FP32_MAX, 1.0])], divisor=0.5) is not None


def test_guard_refuses_an_overflowing_step_and_restores_params_and_momentum() -> None:
    p = _param([3e38, 1.0])
    opt = OuterSGD([p], lr=0.7, momentum=0.9)
    guard = FiniteGuard(opt, [p])
    assert guard.step([torch.tensor([1.0, 1.0])]) is None  # creates the momentum buffer
    before_p = p.data.clone()
    before_b = opt.state[p]["momentum_buffer"].clone()
    # p - 0.7 * g - 0.63 * (0.9 * b + g) with g = -3e38: 3e38 + 2.1e38 + ... overflows.
    why = guard.step([torch.tensor([-3e38, 0.0])])
    assert why is not None and "overflowed" in why
    assert torch.equal(p.data, before_p)
    assert torch.equal(opt.state[p]["momentum_buffer"], before_b)
    assert guard.checked_steps == 2  # both near the fp32 maximum: checked on a copy


def test_guard_keeps_a_large_step_whose_result_is_finite() -> None:
    p = _param([3e38])
    opt = OuterSGD([p], lr=0.5, momentum=0.0, nesterov=False)
    guard = FiniteGuard(opt, [p])
    assert guard.step([torch.tensor([3e38])]) is None  # 3e38 - 1.5e38
    assert p.item() == pytest.approx(1.5e38) and guard.checked_steps == 1


def test_guard_restores_delayed_nesterov_state_including_its_arrival_count() -> None:
    p = _param([3e38])
    opt = DelayedNesterov([p], lr=1.0, momentum=0.9, buffer_size=2)
    guard = FiniteGuard(opt, [p])
    assert guard.step([torch.tensor([1e38])]) is None
    saved = {k: v.clone() for k, v in opt.state[p].items()}
    # delta = -2e38, m = -1e38: p = 2.5e38 + 0.9e38 + 1.5e38 overflows.
    assert guard.step([torch.tensor([-3e38])]) is not None
    for key, value in saved.items():
        assert torch.equal(opt.state[p][key], value), key


def test_guard_checks_any_other_optimizer_on_a_copy() -> None:
    p = _param([1.0])
    opt = torch.optim.SGD([p], lr=1.0)
    guard = FiniteGuard(opt, [p])
    assert guard.step([torch.tensor([0.5])]) is None
    assert p.item() == 0.5 and guard.checked_steps == 1
