"""Logging that a peer cannot turn into a disk flood.

Some lines are written once per request or per connection attempt that anyone who can reach
the socket may make (a bad token, a connection turned away) or once per failed ``accept()``
(asyncio logs ``socket.accept() out of system resource`` with a traceback, once per pending
connection, every time the listening socket wakes up). Each such kind of line goes through a
``LogLimiter``: the first is written, then at most one per interval, which says how many were
left out meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

LOG_INTERVAL = 30.0
"""Seconds between two lines of one kind."""

MAX_KINDS = 256
"""Kinds of line tracked at once; past it a new kind is logged without limit (the kinds are
fixed strings here, so this only bounds memory if one is ever built from peer input)."""


class LogLimiter:
    """``left_out = limiter.allow(kind)``: None means drop this line; a number means write it,
    mentioning that ``left_out`` lines of that kind were dropped before it."""

    def __init__(
        self, interval: float = LOG_INTERVAL, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.interval = interval
        self.clock = clock
        self._last: dict[str, float] = {}
        self._dropped: dict[str, int] = {}

    def allow(self, kind: str) -> int | None:
        now = self.clock()
        last = self._last.get(kind)
        if last is not None and now - last < self.interval:
            self._dropped[kind] = self._dropped.get(kind, 0) + 1
            return None
        if last is not None or len(self._last) < MAX_KINDS:
            self._last[kind] = now
        return self._dropped.pop(kind, 0)

    def note(self, left_out: int) -> str:
        """The suffix of a line after ``left_out`` dropped ones ("" when none were)."""
        if not left_out:
            return ""
        return f" ({left_out} more like it in the last {self.interval:.0f} s not logged)"

    def log(self, logger: logging.Logger, level: int, kind: str, msg: str, *args: Any) -> None:
        """``logger.log(level, msg, *args)``, limited per ``kind``."""
        left_out = self.allow(kind)
        if left_out is not None:
            logger.log(level, msg + "%s", *args, self.note(left_out))


def limit_loop_errors(loop: asyncio.AbstractEventLoop, limiter: LogLimiter) -> None:
    """Route the loop's error reports (asyncio's own ``accept()`` failures among them) through
    ``limiter``, one kind per message."""

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        message = str(context.get("message", "unhandled exception in event loop"))
        left_out = limiter.allow("asyncio: " + message[:100])
        if left_out is None:
            return
        if left_out:
            context = {**context, "message": message + limiter.note(left_out)}
        loop.default_exception_handler(context)

    loop.set_exception_handler(handler)
