"""Steps and bytes per second from counts, on a fake clock (server/members/rates.py): what
/status and the dashboard show long before a worker's first heartbeat."""

from __future__ import annotations

import pytest

from diloco.server.members.rates import Rate
from diloco.server.members.registry import WorkerRegistry
from diloco.server.observe.run_log import RunLog
from diloco.wire.messages import RegisterInfo
from tests.helpers.clock import FakeClock


def test_two_samples_give_the_rate_one_gives_none() -> None:
    rate = Rate(window=10.0)
    assert rate.rate(0.0) is None
    rate.add(100.0, 500)
    assert rate.rate(100.0) is None  # one upload: no time between two counts yet
    rate.add(102.0, 520)
    assert rate.rate(102.0) == pytest.approx(10.0)


def test_bursts_read_as_their_average_over_the_window() -> None:
    rate = Rate(window=10.0)
    # Three bursts of 100 a minute apart, each over one second.
    for start in (0.0, 60.0, 120.0):
        rate.add(start, start / 60 * 100)
        rate.add(start + 1.0, start / 60 * 100 + 100)
    # From the last sample of the burst before (61 s) to the last one (121 s): 100 per 60 s.
    assert rate.rate(121.0) == pytest.approx(100 / 60)


def test_a_count_that_stops_growing_decays() -> None:
    rate = Rate(window=10.0)
    rate.add(0.0, 0)
    rate.add(5.0, 50)
    assert rate.rate(5.0) == pytest.approx(10.0)
    assert rate.rate(10.0) == pytest.approx(10.0)  # silent no longer than the span measured
    assert rate.rate(25.0) == pytest.approx(50 / 20)  # silent 20 s: at most 50 per 20 s


def test_a_lower_count_starts_over() -> None:
    rate = Rate(window=10.0)
    rate.add(0.0, 1000)
    rate.add(1.0, 1010)
    rate.add(2.0, 3)  # the worker restarted under the same id: its steps from 0 again
    assert rate.rate(2.0) is None
    rate.add(3.0, 13)
    assert rate.rate(3.0) == pytest.approx(10.0)


def test_samples_stay_bounded_and_the_rate_exact() -> None:
    rate = Rate(window=1.0)
    for i in range(10_000):
        rate.add(i * 0.01, i * 3)
    assert len(rate._samples) <= 102  # a window's worth, not every sample
    assert rate.rate(99.99) == pytest.approx(300.0)


def test_worker_speed_from_uploads_then_the_newer_heartbeat() -> None:
    clock = FakeClock()
    registry = WorkerRegistry(clock)
    record, _ = registry.add("a", "h", RegisterInfo())
    assert registry.speed(record) is None  # nothing said yet: unknown, not 0
    registry.counted_steps(record, 100)
    clock.now += 4.0
    registry.counted_steps(record, 200)
    assert registry.speed(record) == pytest.approx(25.0)  # long before a heartbeat
    clock.now += 1.0
    registry.reported_speed(record, 30.0)  # the heartbeat is the newer word
    assert registry.speed(record) == 30.0
    registry.reported_speed(record, None)  # a heartbeat that says no speed changes nothing
    assert registry.speed(record) == 30.0
    clock.now += 3.0
    registry.counted_steps(record, 300)  # then an upload is again
    assert registry.speed(record) == pytest.approx(100 / 4)


def test_run_traffic_rate_from_the_first_uploads() -> None:
    clock = FakeClock()
    log = RunLog(clock)
    clock.now += 30.0  # waiting for workers costs nothing in the rate
    log.sent(1000)  # a worker downloads the model
    clock.now += 2.0
    log.received(0, 600)
    log.received(0, 600)
    assert log.traffic.rate(clock.now) == pytest.approx(1200 / 2)
    assert log.submissions == 2
