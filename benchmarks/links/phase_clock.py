"""Where a slow-links round's time goes: wall time of the library's calls, by thread.

``PhaseClock`` wraps a list of the library's methods while it is installed (benchmark-side
instrumentation: the methods are put back on exit) and records every call's thread, phase,
start and end; ``round_phases`` sums one round's calls into phases. Worker threads are named
``link-<i>``; every other thread is the server's.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

# (module, class, method, phase). Worker threads are named ``link-<i>``; every other thread is
# the server's. Nested phases overlap: ``encode`` is inside ``upload``, ``apply`` inside
# ``fetch``, ``fetch`` inside ``refresh``, ``downlink_encode`` inside ``close``.
PHASE_TARGETS = [
    ("diloco.worker.server_mode.plain", "PlainSync", "upload", "upload"),
    ("diloco.worker.state.encoder", "_ModelBody", "encode", "encode"),
    ("diloco.worker.state.local_model", "LocalModel", "produce", "encode"),
    ("diloco.worker.state.encoder", "_ModelBody", "commit", "commit"),
    ("diloco.worker.state.local_model", "LocalModel", "refresh", "refresh"),
    ("diloco.worker.session", "Session", "fetch", "fetch"),
    ("diloco.worker.state.local_model", "LocalModel", "apply_update", "apply"),
    ("diloco.core.accumulate", "WeightedSum", "add", "server_add"),
    ("diloco.core.accumulate", "WeightedSum", "write_first", "server_add"),
    ("diloco.server.rounds.sync_aggregator", "SyncAggregator", "close", "close"),
    ("diloco.server.params.update_bodies", "Downlink", "encode", "downlink_encode"),
]


class PhaseClock:
    """Wraps the methods of ``PHASE_TARGETS`` while installed, recording ``(thread, phase, start,
    end)`` of every call (a generator's time is that of its ``next`` calls: ``LocalModel.produce``
    computes bf16 pieces as the upload streams them). A target missing from the library is
    skipped and named in ``missing``."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, float, float]] = []
        self.missing: list[str] = []
        self._saved: list[tuple[type, str, Any]] = []

    def _note(self, phase: str, t0: float) -> None:
        self.events.append((threading.current_thread().name, phase, t0, time.monotonic()))

    def _wrap(self, fn: Callable[..., Any], phase: str) -> Callable[..., Any]:
        clock = self

        def timed_iter(it: Iterator[Any]) -> Iterator[Any]:
            while True:
                t0 = time.monotonic()
                try:
                    item = next(it)
                except StopIteration:
                    clock._note(phase, t0)
                    return
                clock._note(phase, t0)
                yield item

        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def run_async(*args: Any, **kwargs: Any) -> Any:
                t0 = time.monotonic()
                try:
                    return await fn(*args, **kwargs)
                finally:
                    clock._note(phase, t0)

            return run_async

        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            t0 = time.monotonic()
            try:
                out = fn(*args, **kwargs)
            finally:
                clock._note(phase, t0)
            return timed_iter(out) if inspect.isgenerator(out) else out

        return run

    def __enter__(self) -> PhaseClock:
        for module, cls_name, method, phase in PHASE_TARGETS:
            cls = getattr(importlib.import_module(module), cls_name, None)
            fn = None if cls is None else cls.__dict__.get(method)
            if cls is None or fn is None:
                self.missing.append(f"{module}.{cls_name}.{method}")
                continue
            self._saved.append((cls, method, fn))
            setattr(cls, method, self._wrap(fn, phase))
        return self

    def __exit__(self, *exc: object) -> None:
        for cls, method, fn in reversed(self._saved):
            setattr(cls, method, fn)
        self._saved.clear()

    def round_phases(self, start: float, end: float, workers: list[str]) -> dict[str, float]:
        """One round's phases (calls that began in ``[start, end]``), in seconds: worker phases
        the most any worker spent in them, server phases summed; ``*_at`` are offsets from
        ``start`` (the last upload answered, the server's round close ended)."""
        evs = [e for e in self.events if start <= e[2] <= end]
        out: dict[str, float] = {}

        def per_worker(phase: str) -> float:
            return max(
                (sum(b - a for th, ph, a, b in evs if th == w and ph == phase) for w in workers),
                default=0.0,
            )

        for phase in ("encode", "upload", "commit", "refresh", "fetch", "apply"):
            out[phase] = per_worker(phase)
        mine = set(workers)
        for phase in ("server_add", "close", "downlink_encode"):
            out[phase] = sum(b - a for th, ph, a, b in evs if th not in mine and ph == phase)
        uploads = [b for th, ph, _, b in evs if ph == "upload" and th in mine]
        closes = [b for th, ph, _, b in evs if ph == "close" and th not in mine]
        out["uploads_done_at"] = max(uploads) - start if uploads else math.nan
        out["close_done_at"] = max(closes) - start if closes else math.nan
        out["after_close"] = end - max(closes) if closes else math.nan
        return out
