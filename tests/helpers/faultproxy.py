"""A small TCP proxy for tests that breaks chosen connections at chosen byte counts."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Fault:
    """Cut the connection once ``after`` bytes have gone in ``direction`` ("up": client to
    server, "down": server to client) on a connection whose request starts with ``prefix``."""

    direction: str
    after: int
    prefix: bytes = b""
    then: Callable[[], None] | None = None  # run as the cut happens (kill the server, say)


class FaultProxy:
    def __init__(self, target_port: int) -> None:
        self.target = ("127.0.0.1", target_port)
        self.faults: list[Fault] = []
        self.fired: list[Fault] = []
        #: Bytes relayed so far each way ("up": to the target, "down": back), every connection.
        self.moved = {"up": 0, "down": 0}
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def add(self, fault: Fault) -> None:
        with self._lock:
            self.faults.append(fault)

    def close(self) -> None:
        self._stop.set()
        self._listener.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _count(self, direction: str, n: int) -> None:
        with self._lock:
            self.moved[direction] += n

    def _take(self, data: bytes) -> tuple[Fault, int] | None:
        """The first pending fault whose request prefix appears in ``data``, and where."""
        with self._lock:
            for i, fault in enumerate(self.faults):
                at = data.find(fault.prefix)
                if at >= 0:
                    self.fired.append(fault)
                    return self.faults.pop(i), at
        return None

    def _serve(self, client: socket.socket) -> None:
        """Requests on one connection follow each other (keep-alive), so faults are matched on
        every chunk going up, and counted from where their request starts."""
        try:
            upstream = socket.create_connection(self.target, timeout=10)
        except OSError:
            client.close()
            return
        budget: dict[str, int | None] = {"up": None, "down": None}
        fired_box: list[Fault] = []
        state_lock = threading.Lock()
        done = threading.Event()

        def pump(src: socket.socket, dst: socket.socket, direction: str) -> None:
            try:
                while True:
                    data = src.recv(65536)
                    if not data:
                        break
                    with state_lock:
                        if direction == "up" and budget["up"] is None and budget["down"] is None:
                            hit = self._take(data)
                            if hit is not None:
                                fault, at = hit
                                fired_box.append(fault)
                                budget[fault.direction] = fault.after + (
                                    at if fault.direction == "up" else 0
                                )
                        left = budget[direction]
                        fired = fired_box[-1] if fired_box else Fault(direction, 0)
                        if left is not None and len(data) >= left:
                            dst.sendall(data[:left])
                            self._count(direction, left)
                            if fired.then is not None:
                                fired.then()
                            break  # cut the connection here
                        if left is not None:
                            budget[direction] = left - len(data)
                    dst.sendall(data)
                    self._count(direction, len(data))
            except OSError:
                pass
            finally:
                done.set()

        for direction, (src, dst) in {"up": (client, upstream), "down": (upstream, client)}.items():
            threading.Thread(target=pump, args=(src, dst, direction), daemon=True).start()
        done.wait()
        for sock in (client, upstream):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
