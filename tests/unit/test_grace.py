"""Quorum rounds' maths (core/grace.py) against hand-computed values: the quorum size, the auto
grace window (median + 3 MAD, clamped), the late weight, and the flags' parsing."""

from __future__ import annotations

import math
import re

import pytest

from diloco.core.grace import (
    grace_window,
    late_weight,
    median,
    parse_grace,
    parse_quorum,
    quorum_size,
)


def test_quorum_size_counts_fractions_rounded_up_and_never_below_min_workers() -> None:
    assert quorum_size(2, expected=5, min_workers=1) == 2
    assert quorum_size(0.5, expected=5, min_workers=1) == 3  # 2.5 -> 3
    assert quorum_size(0.3, expected=10, min_workers=1) == 3  # 0.3 x 10 = 3.0000000000000004
    assert quorum_size(1.0, expected=4, min_workers=1) == 4  # the fraction 1.0: everyone
    assert quorum_size(1, expected=4, min_workers=1) == 1  # the count 1: one contribution
    assert quorum_size(2, expected=5, min_workers=3) == 3
    assert quorum_size(0.1, expected=3, min_workers=1) == 1
    with pytest.raises(ValueError):
        quorum_size(0, expected=3, min_workers=1)
    with pytest.raises(ValueError):
        quorum_size(1.5, expected=3, min_workers=1)


def test_flags_parse_or_say_what_is_wrong() -> None:
    assert parse_quorum("3") == 3 and isinstance(parse_quorum("3"), int)
    assert parse_quorum("0.75") == 0.75 and parse_quorum("1.0") == 1.0
    assert isinstance(parse_quorum("1.0"), float)
    for bad, says in (("0", ">= 1"), ("1.5", "(0, 1]"), ("-0.5", "(0, 1]"), ("many", "count")):
        with pytest.raises(ValueError, match=re.escape(says)):
            parse_quorum(bad)
    assert parse_grace("auto") is None and parse_grace("2.5") == 2.5 and parse_grace("0") == 0
    for bad in ("-1", "soon", "inf", "nan"):
        with pytest.raises(ValueError, match="'auto' or seconds"):
            parse_grace(bad)


def test_grace_window_is_median_plus_three_mads_within_its_bounds() -> None:
    # sorted [-2, -1, 0, 0, 4, 10]: median 0; |x - 0| sorted [0, 0, 1, 2, 4, 10]: MAD 1.5
    assert median([-2, 0, 4, -1, 0, 10]) == 0
    assert grace_window([-2, 0, 4, -1, 0, 10], floor=0.0, ceiling=60.0) == 4.5
    # [1, 2, 3, 4, 100]: median 3, deviations [2, 1, 0, 1, 97] -> MAD 1; 3 + 3 = 6: the
    # one frozen worker's 100 s does not stretch the window
    assert grace_window([1, 2, 3, 4, 100], floor=0.0, ceiling=60.0) == 6.0
    assert grace_window([0, 0, 0], floor=1.0, ceiling=60.0) == 1.0  # the floor
    assert grace_window([0, 100, 200], floor=1.0, ceiling=60.0) == 60.0  # 100 + 300, capped
    assert grace_window([], floor=1.0, ceiling=60.0) == 60.0  # nothing known yet: the ceiling
    # [-3, 0, 1, 2]: median 0.5; deviations sorted [0.5, 0.5, 1.5, 3.5] -> MAD 1.0; k = 2
    assert grace_window([-3.0, 0.0, 1.0, 2.0], floor=0.0, ceiling=60.0, k=2.0) == 2.5
    with pytest.raises(ValueError):
        grace_window([1.0], floor=2.0, ceiling=1.0)


def test_late_weight_is_the_inverse_square_root_of_one_plus_lateness() -> None:
    assert late_weight(0) == 1.0
    assert late_weight(1) == pytest.approx(1 / math.sqrt(2))
    assert late_weight(3) == 0.5
