"""Helpers to run a diloco server as a real process (so tests can kill -9 it)."""

from __future__ import annotations

import queue
import re
import subprocess
import sys
import threading
from pathlib import Path

LISTENING = re.compile(r"listening on 127\.0\.0\.1:(\d+)")
ROOT = Path(__file__).resolve().parents[2]


class ServerProcess:
    def __init__(
        self,
        args: list[str],
        log_path: Path,
        timeout: float = 60.0,
        *,
        crash_at: str | None = None,
    ) -> None:
        """``crash_at``: a moment at which the server kills itself (``tests/programs/crashpoint.py``)."""
        self.log_path = log_path
        self._log = open(log_path, "a")  # noqa: SIM115 - closed in stop()
        launcher = ["diloco"] if crash_at is None else ["tests.programs.crashpoint", crash_at, "--"]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", *launcher, "server", "--host", "127.0.0.1", *args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        ports: queue.Queue[int] = queue.Queue()

        def pump() -> None:
            assert self.proc.stderr is not None
            for line in self.proc.stderr:
                self._log.write(line)
                self._log.flush()
                m = LISTENING.search(line)
                if m:
                    ports.put(int(m.group(1)))

        threading.Thread(target=pump, daemon=True).start()
        try:
            self.port = ports.get(timeout=timeout)
        except queue.Empty:
            self.proc.kill()
            raise RuntimeError(
                f"server did not start; log: {log_path.read_text()[-2000:]}"
            ) from None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def wait_exit(self, timeout: float) -> int:
        """Wait for the process to end (killed by a test, or by itself at a crash point)."""
        return self.proc.wait(timeout=timeout)

    def kill9(self) -> None:
        self.proc.kill()  # SIGKILL: no shutdown handler runs, no final save
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._log.close()
