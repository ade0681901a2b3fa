"""Shaped links for benchmarks: each worker reaches a server through a proxy of its own.

``Links(n, rate_mb)`` starts one child process holding ``n`` listening ports; once pointed at a
server (``point_at``), port i forwards to it through two token buckets of ``rate_mb`` MB/s (one
per direction) shared by all of worker i's connections: worker i's link. ``raw_round`` measures
the wire time of a synchronous round's bytes through such links with plain sockets.

Used by ``links/slow_links`` and ``training/compute_utilization``, and by any benchmark that
needs workers behind slow links. MB = 10**6 bytes.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import threading
import time
from typing import Any

MB = 1e6
CHUNK = 64 * 1024


# --- the links: a shaping proxy in its own process --------------------------------------------


class Bucket:
    """A token bucket of ``rate`` bytes/s holding at most ``burst`` bytes."""

    def __init__(self, rate: float, burst: int) -> None:
        self.rate, self.burst = rate, burst
        self.tokens = float(burst)
        self.t = time.monotonic()
        self.lock = threading.Lock()

    def take(self, n: int) -> None:
        while True:
            with self.lock:
                now = time.monotonic()
                self.tokens = min(self.burst, self.tokens + (now - self.t) * self.rate)
                self.t = now
                if self.tokens >= n:
                    self.tokens -= n
                    return
                wait = (n - self.tokens) / self.rate
            time.sleep(wait)


def _pump(src: socket.socket, dst: socket.socket, bucket: Bucket) -> None:
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    try:
        while True:
            n = src.recv_into(buf)
            if not n:
                break
            bucket.take(n)
            dst.sendall(view[:n])
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _link(listener: socket.socket, target: tuple[str, int], up: Bucket, down: Bucket) -> None:
    while True:
        client, _ = listener.accept()
        upstream = socket.create_connection(target, timeout=30)
        upstream.settimeout(None)
        for sock in (client, upstream):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=_pump, args=(client, upstream, up), daemon=True).start()
        threading.Thread(target=_pump, args=(upstream, client, down), daemon=True).start()


def _proxy_main(conn: Any, n: int, rate: float) -> None:
    """One listening port per worker; ``("target", port)`` messages point them at a server."""
    listeners = [socket.create_server(("127.0.0.1", 0)) for _ in range(n)]
    conn.send([sock.getsockname()[1] for sock in listeners])
    started = False
    while True:
        try:
            cmd, port = conn.recv()
        except EOFError:
            return
        if cmd == "target" and not started:
            started = True
            for sock in listeners:
                buckets = (Bucket(rate, 4 * CHUNK), Bucket(rate, 4 * CHUNK))
                args = (sock, ("127.0.0.1", port), *buckets)
                threading.Thread(target=_link, args=args, daemon=True).start()
        conn.send("ok")


class Links:
    """The proxy child: worker i's traffic goes through ``ports[i]``. A proxy serves one target,
    so each server (and the raw limit) gets a proxy of its own."""

    def __init__(self, n: int, rate_mb: float) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_proxy_main, args=(child, n, rate_mb * MB), daemon=True)
        self.proc.start()
        self.ports: list[int] = self._conn.recv()

    def point_at(self, port: int) -> None:
        self._conn.send(("target", port))
        self._conn.recv()

    def close(self) -> None:
        self.proc.kill()
        self.proc.join(5)


# --- the wire time: plain sockets through the same links --------------------------------------


def raw_round(links: Links, up: int, down: int) -> float:
    """N clients each send ``up`` bytes; once all have arrived, each receives ``down`` bytes."""
    n = len(links.ports)
    server = socket.create_server(("127.0.0.1", 0))
    links.point_at(server.getsockname()[1])
    landed = threading.Barrier(n + 1)
    ends: list[float] = []

    def serve() -> None:
        conns = [server.accept()[0] for _ in range(n)]

        def one(c: socket.socket) -> None:
            buf = bytearray(1 << 20)
            got = 0
            while got < up:
                got += c.recv_into(buf, min(len(buf), up - got))
            landed.wait()
            c.sendall(bytes(down))
            c.close()

        threads = [threading.Thread(target=one, args=(c,)) for c in conns]
        for t in threads:
            t.start()
        landed.wait()
        for t in threads:
            t.join()

    def client(port: int) -> None:
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(bytes(up))
        buf = bytearray(1 << 20)
        got = 0
        while got < down:
            n_ = s.recv_into(buf)
            if not n_:
                break
            got += n_
        ends.append(time.monotonic())
        s.close()

    srv = threading.Thread(target=serve)
    srv.start()
    t0 = time.monotonic()
    clients = [threading.Thread(target=client, args=(p,)) for p in links.ports]
    for t in clients:
        t.start()
    for t in clients:
        t.join()
    srv.join()
    server.close()
    return max(ends) - t0


def raw_rounds(n: int, rate_mb: float, up: int, down: int, repeats: int) -> list[float]:
    """``raw_round`` ``repeats`` times, each through fresh links of ``n`` workers."""
    out = []
    for _ in range(repeats):
        links = Links(n, rate_mb)
        try:
            out.append(raw_round(links, up, down))
        finally:
            links.close()
    return out
