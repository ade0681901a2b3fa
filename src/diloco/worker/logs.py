"""The worker's log on stderr when the program configured none.

A training script that never calls ``logging.basicConfig`` would see nothing of the worker:
Python drops INFO records, and its last-resort handler shows only warnings, bare. So
``DiLoCoWorker`` installs one handler on the ``diloco`` logger, at ``WorkerSettings.log_level``,
but only when neither the root logger nor ``diloco`` has a handler: a program that set up its
own logging keeps it as it is. If the program configures the root logger later, the handler
stands aside, so no record is ever shown twice.
"""

from __future__ import annotations

import logging

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class _FallbackHandler(logging.StreamHandler):  # type: ignore[type-arg,unused-ignore]
    """Writes to stderr while the root logger has no handler of its own."""

    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger().handlers:
            return  # the root's handlers show it (the record propagates there)
        super().emit(record)


def show_worker_log(level: str) -> bool:
    """Install the fallback handler on ``diloco`` at ``level`` if nothing logs yet; whether it
    did. Called once per worker; a second worker finds the handler and leaves it."""
    root, package = logging.getLogger(), logging.getLogger("diloco")
    if root.handlers or package.handlers:
        return False
    handler = _FallbackHandler()
    handler.setFormatter(logging.Formatter(FORMAT))
    package.addHandler(handler)
    package.setLevel(level.upper())
    return True
