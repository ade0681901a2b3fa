"""The async staleness policies (core/staleness.py) against values computed by hand, and their
selection by name as the server's settings do it."""

from __future__ import annotations

import math

import pytest

from diloco.core.staleness import (
    POLICY_NAMES,
    AgeGate,
    InverseSqrt,
    NoDecay,
    policy_named,
)
from diloco.server.config import ServerConfig


def test_none_is_one_at_every_age() -> None:
    assert [NoDecay().weight(s) for s in (0, 1, 7, 10_000)] == [1.0, 1.0, 1.0, 1.0]


def test_inverse_sqrt_by_hand() -> None:
    policy = InverseSqrt()
    assert policy.weight(0) == 1.0
    assert policy.weight(3) == 0.5  # 1 / sqrt(4)
    assert policy.weight(8) == pytest.approx(1 / 3)  # 1 / sqrt(9)
    assert policy.weight(1) == pytest.approx(0.7071067811865476)  # 1 / sqrt(2)


def test_age_gate_by_hand() -> None:
    # cutoff 3: (1 + cos(pi s / 4)) / 2 for s = 0..3, then 0.
    gate = AgeGate(3)
    want = [1.0, (1 + math.sqrt(2) / 2) / 2, 0.5, (1 - math.sqrt(2) / 2) / 2, 0.0, 0.0]
    got = [gate.weight(s) for s in range(5)] + [gate.weight(100)]
    assert got == pytest.approx(want, abs=1e-12)
    assert got[1] == pytest.approx(0.8535533905932737)
    assert got[3] == pytest.approx(0.14644660940672624)
    assert gate.weight(4) == 0.0  # exactly 0: the aggregator tests for it


def test_age_gate_cutoff_zero_applies_only_fresh_uploads() -> None:
    gate = AgeGate(0)
    assert (gate.weight(0), gate.weight(1)) == (1.0, 0.0)


@pytest.mark.parametrize("policy", [NoDecay(), InverseSqrt(), AgeGate(5)])
def test_contract_in_unit_interval_non_increasing_and_refuses_negative(policy: object) -> None:
    weights = [policy.weight(s) for s in range(12)]  # type: ignore[attr-defined]
    assert all(0.0 <= w <= 1.0 for w in weights)
    assert weights[0] == 1.0
    assert all(a >= b for a, b in zip(weights, weights[1:], strict=False))
    assert weights == [policy.weight(s) for s in range(12)]  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="staleness must be >= 0"):
        policy.weight(-1)  # type: ignore[attr-defined]


def test_policy_named_builds_each_and_refuses_a_misfit() -> None:
    assert isinstance(policy_named("none"), NoDecay)
    assert isinstance(policy_named("inverse_sqrt"), InverseSqrt)
    gate = policy_named("age_gate", 4)
    assert isinstance(gate, AgeGate) and gate.cutoff == 4
    assert POLICY_NAMES == ("none", "inverse_sqrt", "age_gate")
    with pytest.raises(ValueError, match="needs a cutoff"):
        policy_named("age_gate")
    with pytest.raises(ValueError, match="takes none"):
        policy_named("inverse_sqrt", 3)
    with pytest.raises(ValueError, match="must be one of"):
        policy_named("linear")
    with pytest.raises(ValueError, match="cutoff must be >= 0"):
        AgeGate(-1)


def test_server_settings_select_the_policy_once() -> None:
    ServerConfig(mode="async", staleness_weighting="age_gate", staleness_cutoff=2)
    with pytest.raises(ValueError, match="needs a cutoff"):
        ServerConfig(mode="async", staleness_weighting="age_gate")
    with pytest.raises(ValueError, match="takes none"):
        ServerConfig(mode="async", staleness_cutoff=2)
    with pytest.raises(ValueError, match="need mode='async'"):
        ServerConfig(staleness_weighting="age_gate", staleness_cutoff=2)
