"""Quorum rounds' maths: how many contributions close a round, how long to wait for more after
that, and how much a late contribution counts. Pure functions, no clocks: the server's barrier
(server/rounds/quorum.py) feeds them times it read from its own clock.

The adaptive grace window follows Decoupled DiLoCo (arXiv 2604.21428): once the quorum is in,
wait about as long as the stragglers of recent rounds took after it, robustly (median and
median absolute deviation, so one frozen worker does not stretch the window forever), within
a floor and a ceiling.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from diloco.core.staleness import inverse_sqrt_weight

#: Median + K_MAD x MAD. For normally spread offsets MAD is about 0.67 sigma, so 3 MAD is
#: about 2 sigma: the window covers most of a round's usual stragglers and cuts off the ones
#: that are several spreads out (a frozen or much slower worker), whose work is merged late.
K_MAD = 3.0


def quorum_size(quorum: int | float, expected: int, min_workers: int) -> int:
    """Contributions that make a round's quorum. An ``int`` is a count; a ``float`` in (0, 1]
    a fraction of the ``expected`` workers, rounded up (``1.0``: every expected worker). Never
    below ``min_workers``; above ``expected`` it means every expected worker, which the
    barrier's own rule already closes on."""
    if isinstance(quorum, int):
        if quorum < 1:
            raise ValueError(f"quorum must be >= 1, got {quorum}")
        k = quorum
    else:
        if not 0 < quorum <= 1:
            raise ValueError(f"a fractional quorum must be in (0, 1], got {quorum}")
        k = math.ceil(quorum * expected - 1e-9)  # 0.3 x 10 is 3, not 4 after a rounding error
    return max(k, min_workers, 1)


def parse_quorum(text: str) -> int | float:
    """``--quorum``: ``K`` (an int >= 1, kept as an int) or a fraction in (0, 1] (``0.75``;
    ``1.0`` is every expected worker). Raises ``ValueError`` with what was wrong."""
    try:
        count = int(text)
    except ValueError:
        return _fraction(text)
    if count < 1:
        raise ValueError(f"quorum must be >= 1 (or a fraction in (0, 1]), got {text!r}")
    return count


def _fraction(text: str) -> float:
    try:
        fraction = float(text)
    except ValueError:
        raise ValueError(
            f"quorum must be a count (an int >= 1) or a fraction in (0, 1], got {text!r}"
        ) from None
    if not 0 < fraction <= 1:
        raise ValueError(f"a fractional quorum must be in (0, 1], got {text!r}")
    return fraction


def parse_grace(text: str) -> float | None:
    """``--grace``: ``auto`` (None) or seconds >= 0."""
    if text == "auto":
        return None
    try:
        seconds = float(text)
    except ValueError:
        raise ValueError(f"grace must be 'auto' or seconds >= 0, got {text!r}") from None
    if not (math.isfinite(seconds) and seconds >= 0):
        raise ValueError(f"grace must be 'auto' or seconds >= 0, got {text!r}")
    return seconds


def median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    n = len(ordered)
    if n == 0:
        raise ValueError("median of nothing")
    mid = n // 2
    return ordered[mid] if n % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def grace_window(offsets: Sequence[float], floor: float, ceiling: float, k: float = K_MAD) -> float:
    """Seconds to wait after a round's quorum: median + ``k`` x MAD of ``offsets`` (each
    arrival's delay after its round's quorum, recent rounds), clamped to [floor, ceiling].
    With no offsets at all, the ceiling: nothing is known, so wait as long as allowed (the
    barrier always has the round's own arrivals up to its quorum)."""
    if not 0 <= floor <= ceiling:
        raise ValueError(f"need 0 <= floor <= ceiling, got {floor}, {ceiling}")
    if not offsets:
        return ceiling
    mid = median(offsets)
    mad = median([abs(x - mid) for x in offsets])
    return min(max(mid + k * mad, floor), ceiling)


def late_weight(lateness: int) -> float:
    """The factor a contribution merged ``lateness`` rounds after its base round counts with:
    1/sqrt(1 + lateness), the async mode's staleness weight (one place to change it)."""
    return inverse_sqrt_weight(lateness)
