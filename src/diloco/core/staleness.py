"""Staleness of asynchronous submissions and optional down-weighting."""

from __future__ import annotations

import math


def staleness(server_updates_now: int, base_updates: int) -> int:
    """Outer updates applied since the parameters a worker trained from."""
    if base_updates > server_updates_now:
        raise ValueError(f"base {base_updates} is ahead of the server ({server_updates_now})")
    return server_updates_now - base_updates


def inverse_sqrt_weight(stale: int) -> float:
    """1 / sqrt(1 + s): a fresh submission counts fully, one s updates old counts less."""
    if stale < 0:
        raise ValueError("staleness must be >= 0")
    return 1.0 / math.sqrt(1.0 + stale)
