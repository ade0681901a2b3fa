"""Delayed Nesterov, DyLU and staleness against values computed by hand."""

from __future__ import annotations

import pytest
import torch

from diloco.core import apply_outer_step, default_outer_optimizer
from diloco.core.delayed_nesterov import DelayedNesterov
from diloco.core.dylu import recommended_sync_every, smooth_speed
from diloco.core.staleness import inverse_sqrt_weight, staleness


def run_dn(grads: list[float], **kw: float) -> list[float]:
    p = torch.nn.Parameter(torch.tensor([0.0]), requires_grad=False)
    opt = DelayedNesterov([p], **kw)  # type: ignore[arg-type]
    out = []
    for g in grads:
        apply_outer_step(opt, [p], [torch.tensor([float(g)])])
        out.append(round(p.item(), 10))
    return out


def test_dn_buffer_two_no_activation_by_hand() -> None:
    # lr 1, beta 0.5, N 2, c 0.
    # t1: g=2: p -= 2/2 = 1            -> -1
    # t2: g=4: m = 0.5*0 + (2+4)/2 = 3; p -= (1*0.5*3 + 4/2) = 3.5 -> -4.5
    # t3: g=2: p -= 1                  -> -5.5
    # t4: g=0: m = 0.5*3 + 2/2 = 2.5; p -= (0.5*2.5 + 0) = 1.25 -> -6.75
    assert run_dn([2, 4, 2, 0], lr=1.0, momentum=0.5, buffer_size=2) == [-1.0, -4.5, -5.5, -6.75]


def test_dn_activation_spreads_old_momentum_by_hand() -> None:
    # lr 1, beta 0.5, N 2, c 0.5 (= 1/N).
    # t1: g=2: p -= c*beta*m + g/2 = 0 + 1        -> -1
    # t2: g=4: m = 3; p -= (1 - 1 + 0.5)*0.5*3 + 2 = 0.75 + 2 -> -3.75
    # t3: g=2: p -= 0.5*0.5*3 + 1 = 1.75         -> -5.5
    # t4: g=0: m = 1.5 + 1 = 2.5; p -= 0.5*0.5*2.5 + 0 = 0.625 -> -6.125
    assert run_dn([2, 4, 2, 0], lr=1.0, momentum=0.5, buffer_size=2, activation=0.5) == [
        -1.0,
        -3.75,
        -5.5,
        -6.125,
    ]


def test_dn_buffer_three_by_hand() -> None:
    # lr 0.1, beta 0.9, N 3, c 0, grads 3,3,3 then 0,0,0.
    # t1..t3: each p -= 0.1*1 = 0.1; at t3 also m = 3, p -= 0.1*0.9*3 = 0.27 -> -0.57
    # t4, t5: g = 0, nothing; t6: m = 2.7 + 0 = 2.7, p -= 0.1*0.9*2.7 = 0.243 -> -0.813
    got = run_dn([3, 3, 3, 0, 0, 0], lr=0.1, momentum=0.9, buffer_size=3)
    assert got == pytest.approx([-0.1, -0.2, -0.57, -0.57, -0.57, -0.813])


def test_dn_with_buffer_one_is_nesterov_sgd() -> None:
    grads = [torch.tensor([1.0, -2.0]), torch.tensor([0.5, 0.5]), torch.tensor([-1.0, 3.0])]
    a = torch.nn.Parameter(torch.zeros(2), requires_grad=False)
    b = torch.nn.Parameter(torch.zeros(2), requires_grad=False)
    dn = DelayedNesterov([a], lr=0.7, momentum=0.9, buffer_size=1)
    sgd = default_outer_optimizer([b], lr=0.7, momentum=0.9)
    for g in grads:
        apply_outer_step(dn, [a], [g.clone()])
        apply_outer_step(sgd, [b], [g.clone()])
    torch.testing.assert_close(a, b)


def test_dn_over_a_full_buffer_equals_one_nesterov_step_on_the_average() -> None:
    # c = 0: after N arrivals the parameter moved by lr * (mean + beta * m_new), the Nesterov step.
    grads = [torch.tensor([1.0]), torch.tensor([2.0]), torch.tensor([6.0])]
    a = torch.nn.Parameter(torch.zeros(1), requires_grad=False)
    dn = DelayedNesterov([a], lr=0.5, momentum=0.9, buffer_size=3)
    for g in grads:
        apply_outer_step(dn, [a], [g])
    b = torch.nn.Parameter(torch.zeros(1), requires_grad=False)
    apply_outer_step(default_outer_optimizer([b], lr=0.5, momentum=0.9), [b], [torch.tensor([3.0])])
    torch.testing.assert_close(a, b)
    assert dn.buffered() == 0


def test_dn_rejects_bad_settings() -> None:
    p = [torch.nn.Parameter(torch.zeros(1))]
    with pytest.raises(ValueError):
        DelayedNesterov(p, buffer_size=0)
    with pytest.raises(ValueError):
        DelayedNesterov(p, buffer_size=4, activation=0.3)
    with pytest.raises(ValueError):
        DelayedNesterov(p, momentum=1.0)


def test_dylu_recommendation_by_hand() -> None:
    speeds = {"a": 4.0, "b": 3.0, "c": 1.0, "d": None}
    # floor(v/4 * 100): a 100, b 75, c 25; d has no speed yet -> base
    assert recommended_sync_every(speeds, 100) == {"a": 100, "b": 75, "c": 25, "d": 100}
    assert recommended_sync_every({"a": 100.0, "b": 1.0}, 100, minimum=5)["b"] == 5
    assert recommended_sync_every({}, 10) == {}


def test_speed_smoothing_ignores_post_sync_zeros() -> None:
    v = smooth_speed(None, 10.0)
    assert v == 10.0
    assert smooth_speed(v, 0.0) == 10.0  # a heartbeat right after a sync: no steps, no change
    assert smooth_speed(v, None) == 10.0
    assert smooth_speed(v, 20.0, alpha=0.5) == 15.0


def test_staleness_and_weight() -> None:
    assert staleness(10, 7) == 3
    with pytest.raises(ValueError):
        staleness(3, 4)
    assert inverse_sqrt_weight(0) == 1.0
    assert inverse_sqrt_weight(3) == 0.5
