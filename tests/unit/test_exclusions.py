"""core/robust.py's ``judge``: which members of an all-reduce quorum are left out of a round,
against verdicts computed by hand."""

from __future__ import annotations

import math

import pytest

from diloco.core.robust import judge

MAX = 1e12


def test_a_nan_member_is_left_out_and_the_others_averaged() -> None:
    v = judge([True, False, True], [3.0, math.nan, 5.0], [1.0, 1.0, 1.0], 10.0, MAX)
    assert v.excluded == (1,)
    assert v.reasons[1] == "non-finite pseudo-gradient"
    assert v.weights == (1.0, 0.0, 1.0) and v.total == 2.0
    assert v.bound == pytest.approx(0.5 * 3 + 0.5 * 5)  # 4.0


def test_an_inf_norm_counts_as_non_finite_even_if_the_flag_says_finite() -> None:
    v = judge([True, True], [2.0, math.inf], [1.0, 1.0], 10.0, MAX)
    assert v.excluded == (1,) and v.reasons[1] == "non-finite pseudo-gradient"
    assert v.total == 1.0 and v.bound == 2.0


def test_with_two_members_the_huge_one_is_left_out_by_the_lower_median() -> None:
    # The median of [2, 1e30] taken as the mean (5e29) would admit both; the lower one, 2,
    # sets the limit 20.
    v = judge([True, True], [2.0, 1e30], [1.0, 1.0], 10.0, MAX)
    assert v.excluded == (1,)
    assert v.reasons[1] == "norm 1e+30, 5e+29 x the median 2"
    assert v.weights == (1.0, 0.0) and v.bound == 2.0


def test_with_three_members_the_huge_one_is_left_out() -> None:
    v = judge([True, True, True], [4.0, 1e30, 3.0], [1.0, 1.0, 1.0], 10.0, MAX)
    assert v.excluded == (1,)  # sorted [3, 4, 1e30]: median 4, limit 40
    assert v.total == 2.0 and v.bound == pytest.approx(3.5)


def test_lower_median_of_four_and_the_limit_is_inclusive() -> None:
    # sorted [1, 2, 8, 30]: lower median 2, limit 2 x 10 = 20: 8 stays, 30 goes; a norm of
    # exactly 20 would stay (strictly above is left out).
    v = judge([True] * 4, [30.0, 1.0, 8.0, 2.0], [1.0] * 4, 10.0, MAX)
    assert v.excluded == (0,)
    assert judge([True] * 4, [20.0, 1.0, 8.0, 2.0], [1.0] * 4, 10.0, MAX).excluded == ()


def test_weights_out_of_bounds_or_not_finite_are_left_out_and_the_bound_is_inclusive() -> None:
    norms = [1.0] * 5
    weights = [1e300, -1.0, math.nan, MAX, 0.0]
    v = judge([True] * 5, norms, weights, 10.0, MAX)
    assert v.excluded == (0, 1, 2)
    assert v.reasons[0] == "weight 1e+300 outside [0, 1e+12]"
    assert v.reasons[1] == "weight -1 outside [0, 1e+12]"
    assert v.reasons[2] == "weight nan outside [0, 1e+12]"
    assert v.weights == (0.0, 0.0, 0.0, MAX, 0.0) and v.total == MAX


def test_zero_weights_are_not_judged_by_norm_nor_counted_in_the_median() -> None:
    # Joins (weight 0) with tiny norms would pull the median down to 0.01 and exclude both
    # trainers; they are ignored: median of [5, 6] is 5, limit 50.
    v = judge([True] * 4, [0.01, 5.0, 0.01, 6.0], [0.0, 1.0, 0.0, 1.0], 10.0, MAX)
    assert v.excluded == ()
    assert v.weights == (0.0, 1.0, 0.0, 1.0) and v.bound == pytest.approx(5.5)
    # A join with a huge norm is not left out for it either (it adds nothing) ...
    assert judge([True, True], [1.0, 1e30], [1.0, 0.0], 10.0, MAX).excluded == ()
    # ... but a non-finite one is (it then takes the agreed state).
    assert judge([True, False], [1.0, math.nan], [1.0, 0.0], 10.0, MAX).excluded == (1,)


def test_samples_weights_enter_the_bound() -> None:
    v = judge([True, True, True], [1.0, 2.0, 4.0], [1.0, 3.0, 4.0], 10.0, MAX)
    assert v.excluded == ()
    assert v.bound == pytest.approx((1 * 1 + 3 * 2 + 4 * 4) / 8)


def test_all_left_out_or_all_zero_weight_takes_no_step() -> None:
    v = judge([False, False], [math.nan, math.nan], [1.0, 1.0], 10.0, MAX)
    assert v.excluded == (0, 1) and v.total == 0.0 and v.bound == 0.0
    v = judge([True, True], [1.0, 2.0], [0.0, 0.0], 10.0, MAX)
    assert v.excluded == () and v.total == 0.0 and v.bound == 0.0


def test_a_single_member_and_an_infinite_factor_judge_no_norm() -> None:
    assert judge([True], [1e30], [1.0], 10.0, MAX).excluded == ()  # its own median
    v = judge([True, True], [1.0, 1e30], [1.0, 1.0], math.inf, MAX)
    assert v.excluded == ()


def test_a_zero_median_leaves_out_every_positive_norm() -> None:
    v = judge([True, True, True], [0.0, 0.0, 3.0], [1.0, 1.0, 1.0], 10.0, MAX)
    assert v.excluded == (2,) and v.reasons[2] == "norm 3, above the median 0"


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="one flag, norm and weight"):
        judge([True], [1.0, 2.0], [1.0], 10.0, MAX)
    with pytest.raises(ValueError, match="positive"):
        judge([True], [1.0], [1.0], 0.0, MAX)
