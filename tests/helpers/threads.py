"""Running N workers (or anything else) in threads of the test's process, each thread's failure
reported by the test thread."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def in_threads(n: int, run: Callable[[int], T], timeout: float = 100.0) -> list[T]:
    """``run(i)`` for i in ``range(n)``, each in a thread of its own, started together; each
    thread is joined for at most ``timeout`` seconds. Returns what each returned, by ``i``; an
    exception in any thread fails the test with every thread's, and so does a thread that is
    still running (or that never returned)."""
    results: list[T | None] = [None] * n
    done = [False] * n
    errors: list[BaseException] = []

    def target(i: int) -> None:
        try:
            results[i] = run(i)
            done[i] = True
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            errors.append(exc)

    threads = [threading.Thread(target=target, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not errors, errors
    assert all(done), f"threads still running or lost: {[i for i in range(n) if not done[i]]}"
    return results  # type: ignore[return-value]
