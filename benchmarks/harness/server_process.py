"""``diloco server`` as a child process: started, read, killed with SIGKILL, restarted.

The one server process of the benchmarks and the tests' process helpers. A life is
``python -m diloco server --host 127.0.0.1 --port P ARGS`` (or another launcher module that
ends by running the CLI, e.g. the tests' crash points); its port is read from the
``diloco server listening on 127.0.0.1:PORT`` line of its log, so the first life can take port 0 and every
later life (``start`` again after ``kill9``) listens on the same port, under the same address.
A thread per life copies the child's stderr into the log file (a banner line first) and hands
every line to ``on_line``, so that a benchmark can count what the server logs as it happens.
"""

from __future__ import annotations

import json
import queue
import re
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.harness.source import ROOT

# The HTTP port's line: in all-reduce mode the rendezvous store logs a "listening on" of its own.
LISTENING = re.compile(r"diloco server listening on 127\.0\.0\.1:(\d+)")


class ServerProcess:
    """A server child (see the module docstring). ``args`` follow ``server``; a ``--port`` in them
    wins over the one added here. ``launcher``: the module run with ``-m`` and its arguments
    before ``server``. ``env``: the child's whole environment (default: this one's). The first
    life starts at once unless ``start=False``."""

    def __init__(
        self,
        args: Sequence[str],
        log: Path,
        *,
        launcher: Sequence[str] = ("diloco",),
        env: dict[str, str] | None = None,
        timeout: float = 60.0,
        on_line: Callable[[str, int], None] | None = None,
        start: bool = True,
        token: str | None = None,
    ) -> None:
        self.args, self.log_path, self.launcher = list(args), log, list(launcher)
        self.token = token  # the run's bearer token, for ``status``
        self.env, self.timeout, self.on_line = env, timeout, on_line
        self.port = 0
        self.starts = 0  # lives so far
        self.proc: subprocess.Popen[str] | None = None
        if start:
            self.start()

    def start(self, extra_args: Sequence[str] = ()) -> None:
        """Start a new life (on the port of the last one, if any) and wait until it listens."""
        cmd = [sys.executable, "-m", *self.launcher, "server", "--host", "127.0.0.1"]
        cmd += ["--port", str(self.port), *self.args, *extra_args]
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env=self.env,
        )
        self.proc = proc
        self.starts += 1
        life = self.starts
        ports: queue.Queue[int] = queue.Queue()

        def pump() -> None:
            assert proc.stderr is not None
            with open(self.log_path, "a") as log:
                log.write(f"===== server life {life} (pid {proc.pid}) =====\n")
                log.flush()
                for line in proc.stderr:
                    log.write(line)
                    log.flush()
                    if self.on_line is not None:
                        self.on_line(line, life)
                    m = LISTENING.search(line)
                    if m:
                        ports.put(int(m.group(1)))

        threading.Thread(target=pump, daemon=True).start()
        try:
            self.port = ports.get(timeout=self.timeout)
        except queue.Empty:
            proc.kill()
            tail = self.log_path.read_text()[-2000:] if self.log_path.exists() else ""
            raise RuntimeError(f"server did not start; log {self.log_path}: {tail}") from None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def status(
        self, timeout: float = 2.0, history_since: int | None = None
    ) -> dict[str, Any] | None:
        """``GET /status`` (its loss history from round ``history_since`` on, when given), or
        None if the server does not answer within ``timeout``."""
        query = "" if history_since is None else f"?history_since={history_since}"
        request = urllib.request.Request(f"http://{self.address}/status{query}")
        if self.token:
            request.add_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(request, timeout=timeout) as r:
                reply: dict[str, Any] = json.loads(r.read())
                return reply
        except Exception:
            return None

    def wait_exit(self, timeout: float) -> int:
        """Wait for the life to end (killed from outside, or by itself at a crash point)."""
        assert self.proc is not None
        return self.proc.wait(timeout=timeout)

    def kill9(self) -> None:
        """SIGKILL: no shutdown handler runs, no final save."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        """SIGTERM (a clean shutdown), then SIGKILL if it takes more than 30 s."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
