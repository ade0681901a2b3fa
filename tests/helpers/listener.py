"""A TCP port that answers nothing: whoever connects is left in its backlog, where ``attempts``
finds them. For checking that something made no connection at all."""

from __future__ import annotations

import socket
from types import TracebackType


class Listener:
    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(16)
        self._sock.setblocking(False)
        self.address = f"127.0.0.1:{self._sock.getsockname()[1]}"

    def attempts(self) -> int:
        """Connections made so far (the kernel completes them before ``connect`` returns)."""
        n = 0
        while True:
            try:
                conn, _ = self._sock.accept()
            except BlockingIOError:
                return n
            conn.close()
            n += 1

    def __enter__(self) -> Listener:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._sock.close()
