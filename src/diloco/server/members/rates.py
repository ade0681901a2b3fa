"""Rates of growing counts for display: a worker's inner steps per second from the step counts
its uploads carry, and the run's bytes per second.

A rate is read off samples ``(time, count)`` of a count that only grows. Nothing here reads a
clock: the caller passes the times (the server's clock), so a test drives it with a fake one.

Why not the heartbeat alone: a worker reports its speed once per heartbeat interval (30 s by
default), so a status page showed ``0.0 steps/s`` for the first half minute of a run that had
already closed dozens of rounds. Every upload carries the worker's inner steps so far, so two
uploads give its speed; the run's traffic counters give bytes per second from the first upload.
"""

from __future__ import annotations

from collections import deque

MAX_SAMPLES = 1024  # bounded whatever the upload rate; dropping old ones only shortens the span


class Rate:
    """The growth per second of a count, over at least ``window`` seconds where samples allow.

    The rate is measured up to the newest sample, from the newest sample at least ``window``
    seconds older than it (or the oldest sample held, when none is that old): a count that grows
    in bursts (a round's uploads) reads as its average, not as spikes. A count that stops
    growing decays: the span is never shorter than the time since the last sample, so a stalled
    worker does not keep its last speed forever. A count lower than the last sample (a worker
    restarted under the same id) starts the samples over.
    """

    def __init__(self, window: float = 10.0) -> None:
        if window <= 0:
            raise ValueError(f"window must be > 0, got {window}")
        self.window = window
        self._samples: deque[tuple[float, float]] = deque(maxlen=MAX_SAMPLES)

    @property
    def last_time(self) -> float | None:
        """When the newest sample was taken (None: none yet)."""
        return self._samples[-1][0] if self._samples else None

    def add(self, t: float, count: float) -> None:
        """The count was ``count`` at time ``t`` (times never go back: one monotonic clock)."""
        if self._samples and count < self._samples[-1][1]:
            self._samples.clear()
        self._samples.append((t, count))
        # Keep one sample at least a window older than the newest (the span's start) and the
        # samples after it.
        while len(self._samples) > 2 and self._samples[1][0] <= t - self.window:
            self._samples.popleft()

    def rate(self, now: float) -> float | None:
        """Count per second at ``now``; None until two samples span some time."""
        if len(self._samples) < 2:
            return None
        t0, c0 = self._samples[0]
        t1, c1 = self._samples[-1]
        span = max(t1 - t0, now - t1)
        if span <= 0:
            return None
        return (c1 - c0) / span
