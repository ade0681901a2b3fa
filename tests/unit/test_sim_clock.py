"""The simulated clock of the benchmark trials (benchmarks/harness/sim_clock.py, issue 32): the
order in which it lets workers upload, against schedules computed by hand. Worker threads with no
server: each takes its steps on the clock and, every ``h`` steps, passes the gate, "uploads"
(appends to a log while it holds the clock) and releases."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
from benchmarks.harness.sim_clock import ClockSettings, SimClock


def run_workers(clock: SimClock, body: Callable[[int], None], start_order: list[int]) -> None:
    """One thread per rank running ``body(rank)``, started in ``start_order``; the clock is
    told each has finished, as the harness does, even when it raises."""
    errors: list[BaseException] = []

    def work(rank: int) -> None:
        try:
            body(rank)
        except BaseException as exc:  # reported below
            errors.append(exc)
        finally:
            clock.finish(rank)

    threads = {r: threading.Thread(target=work, args=(r,)) for r in start_order}
    for r in start_order:
        threads[r].start()
    for t in threads.values():
        t.join(timeout=30)
    assert not errors, errors


def uploads_every(clock: SimClock, h: int, steps: int, log: list[tuple[str, float, int]]):
    def body(rank: int) -> None:
        for i in range(steps):
            assert clock.step(rank)
            if (i + 1) % h == 0:
                t = clock.gate(rank)
                log.append(("up", t, rank))
                clock.uploaded(rank, i // h)
                clock.resumed(rank)  # sync: the barrier a server would hold the worker in
                if clock.holds(rank):  # async: the download, still holding the clock
                    log.append(("down", clock.now[rank], rank))
                clock.release(rank)

    return body


@pytest.mark.parametrize("start_order", [[0, 1, 2], [2, 1, 0]])
def test_async_uploads_in_simulated_time_order(start_order: list[int]) -> None:
    """Steps of 1, 2 and 3 s, an upload every 2 steps, 6 steps each: uploads at 2, 4, 6
    (rank 0), 4, 8, 12 (rank 1) and 6, 12, 18 (rank 2), merged by time, ties to the lower rank,
    whichever thread the OS runs first."""
    clock = SimClock([1.0, 2.0, 3.0], seed=0)
    log: list[tuple[str, float, int]] = []
    run_workers(clock, uploads_every(clock, 2, 6, log), start_order)
    expected = [(2, 0), (4, 0), (4, 1), (6, 0), (6, 2), (8, 1), (12, 1), (12, 2), (18, 2)]
    assert [(t, r) for kind, t, r in log if kind == "up"] == expected
    assert clock.uploads == expected
    assert clock.end == 18


def test_sync_round_takes_the_slowest_workers_time() -> None:
    """Sync: rounds close at the slowest upload (6, 12, 18) and everyone resumes from there, so
    rank 0's second upload is at 6 + 2 = 8, not 4."""
    clock = SimClock([1.0, 2.0, 3.0], seed=0, sync=True)
    log: list[tuple[str, float, int]] = []
    run_workers(clock, uploads_every(clock, 2, 6, log), [0, 1, 2])
    ups = [(t, r) for kind, t, r in log if kind == "up"]
    assert ups == [(2, 0), (4, 1), (6, 2), (8, 0), (10, 1), (12, 2), (14, 0), (16, 1), (18, 2)]
    assert clock.end == 18


def test_grace_period_defers_the_download_past_uploads_in_the_window() -> None:
    """Grace 1 s, steps of 1 and 1.25 s, an upload every 2 steps, 4 steps each: rank 0 uploads
    at 2 and downloads at 3, after rank 1's upload at 2.5 (inside its window); it resumes from 3,
    so its next upload is at 5. At 6 rank 0's download (6, rank 0) comes before rank 1's upload
    (6, rank 1)."""
    clock = SimClock([1.0, 1.25], seed=0, settings=ClockSettings(grace=1.0))
    log: list[tuple[str, float, int]] = []
    run_workers(clock, uploads_every(clock, 2, 4, log), [1, 0])
    assert log == [
        ("up", 2, 0), ("up", 2.5, 1), ("down", 3, 0), ("down", 3.5, 1),
        ("up", 5, 0), ("down", 6, 0), ("up", 6, 1), ("down", 7, 1),
    ]  # fmt: skip


def test_shared_budget_goes_to_the_earliest_step_starts() -> None:
    """A shared budget of 8 steps, steps of 1 and 3 s: the starts in time order are 0 (both),
    1, 2, 3 (both), 4, 5, so rank 0 takes 6 steps and rank 1 two."""
    clock = SimClock([1.0, 3.0], seed=0, total=8)
    taken = [0, 0]

    def body(rank: int) -> None:
        while clock.step(rank):
            taken[rank] += 1

    run_workers(clock, body, [1, 0])
    assert taken == [6, 2]
    assert clock.steps_done(5.0) == 6  # ends at 1..5 (rank 0) and 3 (rank 1)


def test_time_budget_stops_steps_starting_at_or_after_it() -> None:
    """until = 6 s, steps of 1 and 2.5 s: rank 0 starts steps at 0..5 (6 steps), rank 1 at 0,
    2.5 and 5 (3 steps); the lr schedule's progress is the time over the budget."""
    clock = SimClock([1.0, 2.5], seed=0, settings=ClockSettings(until=6.0), total=10**6)
    taken = [0, 0]

    def body(rank: int) -> None:
        while clock.step(rank):
            taken[rank] += 1

    run_workers(clock, body, [0, 1])
    assert taken == [6, 3]
    assert clock.now == [6.0, 7.5] and clock.progress(1) == 1.0


def test_jitter_is_seeded_and_bounded() -> None:
    """Each step costs its worker's cost times a factor in [1 - jitter, 1 + jitter], drawn from
    a generator seeded by (seed, rank): the same seed gives the same times."""

    def times(seed: int) -> list[float]:
        clock = SimClock([1.0], seed=seed, settings=ClockSettings(jitter=0.2))
        out = []
        for _ in range(50):
            before = clock.now[0]
            clock.step(0)
            out.append(clock.now[0] - before)
        return out

    assert times(3) == times(3) and times(3) != times(4)
    assert all(0.8 <= c <= 1.2 for c in times(3))


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="jitter"):
        ClockSettings(jitter=1.0)
    with pytest.raises(ValueError, match="grace"):
        ClockSettings(grace=-1)
    with pytest.raises(ValueError, match="until"):
        ClockSettings(until=-1)
    with pytest.raises(ValueError, match="positive"):
        SimClock([1.0, 0.0], seed=0)
