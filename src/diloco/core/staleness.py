"""Staleness of asynchronous submissions and the policies that weight a submission by it.

A policy maps staleness (outer updates applied since the parameters a worker trained from) to
the factor its pseudo-gradient is applied with. The async aggregator asks its policy once per
upload; a factor of 0 means the upload is acknowledged but not applied (the age gate).
"""

from __future__ import annotations

import math
from typing import Protocol

POLICY_NAMES = ("none", "inverse_sqrt", "age_gate")
"""The policies ``policy_named`` builds, as ``--staleness-weighting`` names them."""


def staleness(server_updates_now: int, base_updates: int) -> int:
    """Outer updates applied since the parameters a worker trained from."""
    if base_updates > server_updates_now:
        raise ValueError(f"base {base_updates} is ahead of the server ({server_updates_now})")
    return server_updates_now - base_updates


def _check(stale: int) -> None:
    if stale < 0:
        raise ValueError(f"staleness must be >= 0, got {stale}")


class StalenessPolicy(Protocol):
    """How much a submission ``staleness`` updates old counts.

    Contract: ``weight`` is pure (the same staleness always gives the same factor, no state),
    returns a float in [0, 1], returns 1 for staleness 0 except where a policy says otherwise,
    does not increase with staleness, and raises ``ValueError`` for a negative staleness.
    0 means "do not apply": the caller acknowledges the upload without changing a parameter.
    """

    def weight(self, stale: int) -> float: ...


class NoDecay:
    """Every submission counts fully, however old (``none``)."""

    def weight(self, stale: int) -> float:
        _check(stale)
        return 1.0


class InverseSqrt:
    """1 / sqrt(1 + s): a fresh submission counts fully, one s updates old counts less, never
    nothing (``inverse_sqrt``)."""

    def weight(self, stale: int) -> float:
        _check(stale)
        return 1.0 / math.sqrt(1.0 + stale)


class AgeGate:
    """A raised cosine that falls from 1 at staleness 0 towards 0 and is exactly 0 past
    ``cutoff`` (``age_gate``): ``(1 + cos(pi * s / (cutoff + 1))) / 2`` for ``s <= cutoff``.

    CGAD (arXiv 2605.09126) gates stale pseudo-gradients with a cosine that reaches zero at a
    cutoff, times an exponential decay. The exponential's rate is a second knob tuned at scale;
    here the cosine alone decays, so one number (the cutoff) says how old is too old. The
    cosine's zero sits one update past the cutoff so that ``cutoff`` itself still counts a
    little (the flag reads "apply up to S updates old"), and the fall is smooth: a submission
    one update older never weighs abruptly less than its neighbour."""

    def __init__(self, cutoff: int) -> None:
        if cutoff < 0:
            raise ValueError(f"the age gate's cutoff must be >= 0, got {cutoff}")
        self.cutoff = cutoff

    def weight(self, stale: int) -> float:
        _check(stale)
        if stale > self.cutoff:
            return 0.0
        return 0.5 * (1.0 + math.cos(math.pi * stale / (self.cutoff + 1)))


def policy_named(name: str, cutoff: int | None = None) -> StalenessPolicy:
    """The policy ``--staleness-weighting NAME`` selects; ``cutoff``: the age gate's (required
    by ``age_gate``, refused by the others). ``ValueError`` on an unknown name."""
    if name == "age_gate":
        if cutoff is None:
            raise ValueError("staleness weighting 'age_gate' needs a cutoff (--staleness-cutoff)")
        return AgeGate(cutoff)
    if cutoff is not None:
        raise ValueError(f"a staleness cutoff is the age gate's; {name!r} takes none")
    if name == "none":
        return NoDecay()
    if name == "inverse_sqrt":
        return InverseSqrt()
    raise ValueError(f"staleness weighting must be one of {', '.join(POLICY_NAMES)}, got {name!r}")


def inverse_sqrt_weight(stale: int) -> float:
    """1 / sqrt(1 + s) (``InverseSqrt``'s weight, as a function)."""
    return InverseSqrt().weight(stale)
