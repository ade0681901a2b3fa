"""A diloco server as a real process, so tests can kill -9 it: the benchmarks' server process
(``benchmarks/harness/server_process.py``), launched through the tests' crash points
(``tests/programs/crashpoint.py``) when a test names a moment to die at."""

from __future__ import annotations

from pathlib import Path

from benchmarks.harness import server_process


class ServerProcess(server_process.ServerProcess):
    def __init__(
        self,
        args: list[str],
        log_path: Path,
        timeout: float = 60.0,
        *,
        crash_at: str | None = None,
    ) -> None:
        """``crash_at``: a moment at which the server kills itself (``tests/programs/crashpoint.py``)."""
        launcher = ["diloco"] if crash_at is None else ["tests.programs.crashpoint", crash_at, "--"]
        super().__init__(args, log_path, launcher=launcher, timeout=timeout)
