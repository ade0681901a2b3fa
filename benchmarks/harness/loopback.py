"""The raw-socket limit: what plain TCP on this machine needs to move a round's bytes.

N plain-socket client processes each send the upload size to one server process, which
receives every upload into one preallocated buffer and then sends the download size back to
each client: the same bytes in the same pattern as a synchronous DiLoCo round, with no HTTP, no
Python-level copies and no tensor work. It is a ceiling, not a target a real server can meet
exactly. ``LoopbackRun`` drives it one round at a time, so that a benchmark can put each raw
round right beside one of its own and both see the same load on a shared machine.
"""

from __future__ import annotations

import os
import socket
import statistics
import threading
import time
from typing import Any

from benchmarks.harness.report import MB, cpu_median, summary
from benchmarks.harness.rss import maxrss
from benchmarks.harness.session import Session

SOCKBUF = 4 * 1024 * 1024


def estimate_loopback_bytes(n: int, model_bytes: int) -> int:
    """The raw-socket processes: the server's receive and send buffers (half a model and a
    model), one model-sized buffer per client, and an interpreter (~40 MB) each."""
    overhead = 40 * 2**20
    return int(1.5 * model_bytes + overhead + n * (model_bytes + overhead))


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKBUF)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKBUF)


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    pos, size = 0, len(view)
    while pos < size:
        n = sock.recv_into(view[pos:], size - pos)
        if n == 0:
            raise ConnectionError(f"peer closed with {size - pos} bytes to go")
        pos += n


def _raw_server_main(conn: Any, num_clients: int, up: int, down: int, rounds: int) -> None:
    """The hub of the raw-socket session: its hello names its port; after the last round it
    answers ``"stop"`` with its errors and peak RSS."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    _tune(listener)  # inherited by accepted sockets: the window is sized before the handshake
    listener.bind(("127.0.0.1", 0))
    listener.listen(num_clients)
    conn.send({"pid": os.getpid(), "port": listener.getsockname()[1]})
    recv_buf = memoryview(bytearray(up))  # one receive buffer, as the server's one upload slot
    send_buf = memoryview(bytearray(down))  # one published payload, streamed to everyone
    uploads_done = threading.Barrier(num_clients)
    errors: list[BaseException] = []

    def serve(sock: socket.socket) -> None:
        try:
            for _ in range(rounds):
                _recv_exact(sock, recv_buf)
                uploads_done.wait(600)  # every upload is in before any download starts
                sock.sendall(send_buf)
        except BaseException as exc:
            errors.append(exc)
            uploads_done.abort()
        finally:
            sock.close()

    threads = []
    listener.settimeout(600)
    for _ in range(num_clients):
        sock, _addr = listener.accept()
        sock.settimeout(600)
        t = threading.Thread(target=serve, args=(sock,), daemon=True)
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    listener.close()
    try:
        conn.recv()  # "stop"
    except EOFError:
        return  # the parent went
    conn.send({"errors": [repr(e) for e in errors], "maxrss": maxrss()})


def _raw_client_main(
    idx: int, out: Any, port: int, up: int, down: int, rounds: int, barrier: Any
) -> None:
    """A member of the raw-socket session."""
    try:
        buf = memoryview(bytearray(max(up, down)))  # sent from, then received into (as a worker)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        _tune(sock)
        sock.settimeout(600)
        sock.connect(("127.0.0.1", port))
        out.put(("ready", idx, None))
        for r in range(rounds):
            barrier.wait(600)
            t0, c0 = time.monotonic(), time.process_time()
            sock.sendall(buf[:up])
            t_sent = time.monotonic()
            _recv_exact(sock, buf[:down])
            t1, c1 = time.monotonic(), time.process_time()
            out.put(
                ("round", idx, {"round": r, "t0": t0, "sent": t_sent, "t1": t1, "cpu_s": c1 - c0})
            )
        sock.close()
        out.put(("done", idx, {"maxrss": maxrss()}))
    except BaseException as exc:
        out.put(("error", idx, f"{type(exc).__name__}: {exc}"))
        raise


class LoopbackRun:
    """The raw-socket limit: a plain server process and N client processes, one round at a time:
    a ``Session`` (without RSS polling: the parent's poller would load the machine whose ceiling
    this measures).

    ``up`` and ``down`` are one client's bytes per round; the first ``warmup`` of the
    ``warmup + rounds`` rounds are marked and left out of the summaries."""

    def __init__(
        self,
        ctx: Any,
        n: int,
        up: int,
        down: int,
        *,
        warmup: int,
        rounds: int,
        setup_timeout: float,
        round_timeout: float,
        verbose: bool = False,
    ) -> None:
        self.n, self.up, self.down = n, up, down
        self.warmup, self.verbose = warmup, verbose
        self.session = Session(
            ctx,
            n,
            total_rounds=warmup + rounds,
            setup_timeout=setup_timeout,
            round_timeout=round_timeout,
            poll_rss=False,
        )
        self.rounds: list[dict[str, Any]] = []

    def __enter__(self) -> LoopbackRun:
        s = self.session.__enter__()
        try:
            total = s.total_rounds
            hello = s.start_hub(_raw_server_main, (self.n, self.up, self.down, total), "raw-server")
            s.start_members(
                _raw_client_main,
                lambda i: (hello["port"], self.up, self.down, total, s.barrier),
                "raw-client",
            )
        except BaseException:
            s.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.session.__exit__()

    def round(self) -> dict[str, Any]:
        n, s = self.n, self.session
        r = len(self.rounds)
        what = f"loopback N={n} round {r}"
        s.check(what)
        msgs, cpu = s.run_round(what)  # raw clients have nothing to prepare between rounds
        t0 = min(m["t0"] for m in msgs.values())
        result = {
            "round": r,
            "warmup": r < self.warmup,
            "t0": t0,
            "wall_s": max(m["t1"] for m in msgs.values()) - t0,
            "uploads_sent_s": max(m["sent"] for m in msgs.values()) - t0,
            "cpu_s": cpu,
        }
        self.rounds.append(result)
        if self.verbose:
            print(f"    N={n} loopback round {r}: {result['wall_s']:.3f} s", flush=True)
        return result

    def finish(self) -> dict[str, Any]:
        n, s = self.n, self.session
        s.finish_members(f"loopback N={n} shutdown")
        final = s.stop_hub()
        if final["errors"]:
            raise RuntimeError(f"raw server errors: {final['errors']}")
        s.join_members()
        measured = [r for r in self.rounds if not r["warmup"]]
        return {
            "workers": n,
            "upload_bytes": self.up,
            "download_bytes": self.down,
            "rounds": self.rounds,
            "round_s": summary([r["wall_s"] for r in measured]),
            "cpu_s_median": cpu_median(self.rounds),
            "throughput_MBps": (n * (self.up + self.down))
            / statistics.median(r["wall_s"] for r in measured)
            / MB,
        }
