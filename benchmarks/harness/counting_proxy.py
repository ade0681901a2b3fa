"""A counting TCP proxy in its own process: every byte a client and a server exchange, counted.

``CountingProxy(ctx, names)`` starts one child process (pure Python, no torch) that listens on
one loopback port per name. Once pointed at its targets (``point_at``), each accepted connection
is relayed to its listener's target by two threads, one per direction, that move the bytes with
``os.splice`` (socket -> pipe -> socket, in the kernel: no copy through Python, so that relaying
hundreds of MB costs the machine little) and count them. ``counts()`` returns, per name, the
bytes that went to the target (``in``: into the server process), the bytes that came back
(``out``) and the connections accepted so far; the difference of two readings brackets whatever
happened between them.

What is counted is TCP payload (what the two ends wrote into their sockets), not the packet
headers. A relay adds one hop on loopback: its cost is what ``allreduce_round.py`` measures
when it runs a configuration both through the proxy and directly (``--direct``).
"""

from __future__ import annotations

import fcntl
import os
import socket
import threading
from typing import Any

CHUNK = 1 << 20  # bytes asked of one splice; the pipe is enlarged to match where allowed
F_SETPIPE_SZ = 1031  # fcntl.F_SETPIPE_SZ (Python 3.10+ names it; the constant is Linux's)


class _Listener:
    def __init__(self, name: str) -> None:
        self.name = name
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(256)
        self.port = int(self.sock.getsockname()[1])
        self.target: tuple[str, int] | None = None
        self.bytes_in = 0  # client -> target
        self.bytes_out = 0  # target -> client
        self.connections = 0
        self.lock = threading.Lock()

    def add(self, direction: str, n: int) -> None:
        with self.lock:
            if direction == "in":
                self.bytes_in += n
            else:
                self.bytes_out += n

    def counts(self) -> dict[str, int]:
        with self.lock:
            return {"in": self.bytes_in, "out": self.bytes_out, "connections": self.connections}


def _relay(src: socket.socket, dst: socket.socket, listener: _Listener, direction: str) -> None:
    """Move ``src``'s bytes to ``dst`` until ``src`` ends, counting them; then half-close
    ``dst`` so that the other end sees the end too."""
    r, w = os.pipe()
    try:
        try:
            fcntl.fcntl(w, F_SETPIPE_SZ, CHUNK)
        except OSError:
            pass  # the default pipe size (64 KiB) still works, in more calls
        flags = getattr(os, "SPLICE_F_MOVE", 1)
        while True:
            try:
                n = os.splice(src.fileno(), w, CHUNK, flags=flags)
            except OSError:
                break
            if n == 0:
                break
            listener.add(direction, n)
            left = n
            while left:
                try:
                    m = os.splice(r, dst.fileno(), left, flags=flags)
                except OSError:
                    return
                left -= m
    finally:
        os.close(r)
        os.close(w)
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass


def _serve_connection(client: socket.socket, listener: _Listener) -> None:
    assert listener.target is not None
    try:
        upstream = socket.create_connection(listener.target)
    except OSError:
        client.close()
        return
    for s in (client, upstream):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    back = threading.Thread(target=_relay, args=(upstream, client, listener, "out"), daemon=True)
    back.start()
    _relay(client, upstream, listener, "in")
    back.join()
    client.close()
    upstream.close()


def _accept_loop(listener: _Listener) -> None:
    while True:
        try:
            client, _ = listener.sock.accept()
        except OSError:
            return
        with listener.lock:
            listener.connections += 1
        threading.Thread(target=_serve_connection, args=(client, listener), daemon=True).start()


def proxy_main(conn: Any, names: list[str]) -> None:
    """The proxy child: sends its ports ({name: port}), takes its targets ({name: (host,
    port)}), then answers ``"counts"`` until ``"stop"`` or the parent goes away."""
    listeners = {name: _Listener(name) for name in names}
    conn.send({name: lst.port for name, lst in listeners.items()})
    try:
        targets = conn.recv()
    except EOFError:
        return
    if not isinstance(targets, dict):  # "stop" before any target: nothing was relayed
        conn.send("stopped")
        return
    for name, target in targets.items():
        listeners[name].target = (str(target[0]), int(target[1]))
    for lst in listeners.values():
        if lst.target is not None:
            threading.Thread(target=_accept_loop, args=(lst,), daemon=True).start()
    conn.send("ok")
    while True:
        try:
            cmd = conn.recv()
        except EOFError:
            return
        if cmd == "counts":
            conn.send({name: lst.counts() for name, lst in listeners.items()})
        elif cmd == "stop":
            conn.send("stopped")
            return


class CountingProxy:
    """The parent's handle on a proxy child (see the module docstring)."""

    def __init__(self, ctx: Any, names: list[str], timeout: float = 60.0) -> None:
        self.timeout = timeout
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=proxy_main, args=(child, names), daemon=True)
        self.proc.start()
        self.ports: dict[str, int] = self._recv()

    def _recv(self) -> Any:
        if not self._conn.poll(self.timeout):
            raise TimeoutError("the counting proxy did not answer")
        return self._conn.recv()

    def address(self, name: str) -> tuple[str, int]:
        return "127.0.0.1", self.ports[name]

    def point_at(self, targets: dict[str, tuple[str, int] | None]) -> None:
        """Each name's target (None: that listener accepts nothing)."""
        self._conn.send({k: v for k, v in targets.items() if v is not None})
        if self._recv() != "ok":
            raise RuntimeError("the counting proxy refused its targets")

    def counts(self) -> dict[str, dict[str, int]]:
        self._conn.send("counts")
        return self._recv()

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self._conn.send("stop")
                self._recv()
            except (OSError, TimeoutError, EOFError):
                pass
        self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


def diff(after: dict[str, dict[str, int]], before: dict[str, dict[str, int]]) -> dict[str, Any]:
    """Per name, the bytes each way and the connections between two ``counts()``."""
    return {
        name: {k: after[name][k] - before.get(name, {}).get(k, 0) for k in after[name]}
        for name in after
    }
