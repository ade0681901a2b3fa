"""The driver's choice of replicas and its call timeouts (swarm/routing.py), on given
measurements: no sockets, no clock."""

from __future__ import annotations

from collections import Counter

import pytest

from diloco.swarm import Endpoint, NoReplica, Picker, StaticRoutes

A, B, C = (Endpoint(f"http://10.0.0.{i}:8700", "t") for i in range(3))


def test_choice_is_weighted_by_measured_throughput_and_new_replicas_get_tried() -> None:
    picker = Picker(seed=0)
    picker.measured(1, A, samples=300, seconds=1.0)  # 300 samples/s
    picker.measured(1, B, samples=100, seconds=1.0)  # 100 samples/s
    counts = Counter(picker.pick([A, B], 1) for _ in range(4000))
    assert 0.70 < counts[A] / 4000 < 0.80  # 3 : 1
    # C was never measured: it weighs as much as the best measured replica.
    counts = Counter(picker.pick([A, B, C], 1) for _ in range(7000))
    assert 0.38 < counts[C] / 7000 < 0.48  # 3 : 1 : 3
    with pytest.raises(NoReplica, match="stage 2"):
        picker.pick([], 2)


def test_throughput_is_a_moving_average() -> None:
    picker = Picker()
    picker.measured(1, A, 100, 1.0)
    picker.measured(1, A, 200, 1.0)
    assert picker.throughput() == {A.url: pytest.approx(0.8 * 100 + 0.2 * 200)}


def test_timeout_follows_the_slowest_recent_call_within_its_bounds() -> None:
    picker = Picker(timeout_floor_s=0.5, first_timeout_s=10.0, latency_factor=4.0, window=3)
    assert picker.timeout(1) == 10.0  # nothing measured yet
    picker.measured(1, A, 1, 0.01)
    assert picker.timeout(1) == 0.5  # 4 x 0.01 is under the floor
    picker.measured(1, A, 1, 1.0)
    assert picker.timeout(1) == 4.0
    for _ in range(3):  # the slow call leaves the window
        picker.measured(1, B, 1, 0.2)
    assert picker.timeout(1) == pytest.approx(0.8)
    picker.measured(1, A, 1, 1000.0)
    assert picker.timeout(1) == 120.0  # the cap
    assert picker.timeout(2) == 10.0  # stages are measured apart
    with pytest.raises(ValueError):
        Picker(timeout_floor_s=0.0)


def test_static_routes_leave_a_suspect_out_until_restored() -> None:
    routes = StaticRoutes({1: [A, B]})
    routes.suspect(A, "reset")
    assert routes.endpoints(1) == [B] and routes.suspects == {A: "reset"}
    routes.restore(A)
    assert routes.endpoints(1) == [A, B] and routes.endpoints(2) == []
