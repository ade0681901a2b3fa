"""A fake monotonic clock for state machines that take one (barrier, health, quorums)."""

from __future__ import annotations


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now
