"""Synchronous rounds when every worker sits behind its own slow link, for 1, 2, ... upload slots.

The loopback benchmark (``sync_round.py``) measures CPU overhead: on loopback the bytes move at
memory speed. Real workers reach the server over links of their own (a 1 Gbit office line, a
cloud region's egress), often slower than the server's. Then what matters is how many uploads
the server takes in at once: it receives an upload whole into a receive buffer before any of it
counts, and with one buffer (``upload_slots=1``, the default: memory flat in N) the uploads of a
round arrive one after the other, each at one link's speed.

Here each worker reaches the server through a shaping proxy (a child process, token buckets of
``--rate`` MB/s per worker and direction, shared by all of that worker's connections: its link).
The server and the workers run in this process (threads; torch releases the GIL in its kernels
and the links, not the CPU, set the pace). For each slot count a fresh server is started and the
round time is compared with the wire time: the same bytes through the same proxies with plain
sockets (N clients upload, then each gets its download), measured beside the rounds.

    .venv/bin/python benchmarks/slow_links.py --params 25e6 --workers 4 --rate 50 --slots 1 2 4

MB = 10**6 bytes.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import socket
import statistics
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


# --- DiLoCo rounds ----------------------------------------------------------------------------


def build_model(params: float) -> Any:
    import torch

    dim = 1024
    layers = max(1, round(params / (dim * dim)))
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(dim, dim, bias=False) for _ in range(layers)])


def diloco_rounds(links: Links, params: float, slots: int, rounds: int) -> dict[str, Any]:
    import torch

    from diloco import DiLoCoServer, DiLoCoWorker, ServerConfig

    n = len(links.ports)
    initial = {name: p.detach().clone() for name, p in build_model(params).named_parameters()}
    server = DiLoCoServer(
        ServerConfig(port=0, num_workers=n, upload_slots=slots, heartbeat_timeout=0),
        initial_params=initial,
    ).start()
    del initial
    links.point_at(server.port)
    start = threading.Barrier(n)
    times: dict[int, list[tuple[float, float]]] = {i: [] for i in range(n)}
    errors: list[BaseException] = []
    sizes: dict[str, int] = {}

    def worker(i: int) -> None:
        try:
            model = build_model(params)
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
            gen = torch.Generator().manual_seed(100 + i)
            with DiLoCoWorker(
                model,
                opt,
                f"127.0.0.1:{links.ports[i]}",
                sync_every=10**9,
                worker_id=f"link-{i}",
                heartbeat_interval=0,
            ) as w:
                for _ in range(rounds + 1):  # the first is a warm-up
                    with torch.no_grad():
                        for p in model.parameters():
                            p.add_(torch.randn(p.shape, generator=gen), alpha=1e-3)
                    start.wait(600)
                    t0 = time.monotonic()
                    up0, down0 = w.sync_metrics["bytes_up"], w.sync_metrics["bytes_down"]
                    w.force_sync()
                    times[i].append((t0, time.monotonic()))
                    sizes["up"] = w.sync_metrics["bytes_up"] - up0
                    sizes["down"] = w.sync_metrics["bytes_down"] - down0
                start.wait(600)  # nobody leaves (and deregisters) before the last round ends
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            errors.append(exc)
            start.abort()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    status = server.status()
    server.stop(timeout=10)
    if errors:
        raise RuntimeError(f"a worker failed: {errors[0]!r}") from errors[0]
    walls = [
        max(times[i][r][1] for i in range(n)) - min(times[i][r][0] for i in range(n))
        for r in range(1, rounds + 1)
    ]
    return {"round_s": walls, "up": sizes["up"], "down": sizes["down"], "status": status}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=float, default=25e6, help="model parameters (default 25e6)")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--rate", type=float, default=50.0, help="MB/s per worker and direction")
    ap.add_argument("--slots", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--rounds", type=int, default=3, help="measured rounds per slot count")
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON")
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    results = []
    print(
        f"{args.workers} workers, {args.params / 1e6:.0f}M parameters, links of {args.rate:g} MB/s "
        "per worker and direction (shaping proxies)",
        flush=True,
    )
    for slots in args.slots:
        links = Links(args.workers, args.rate)
        try:
            run = diloco_rounds(links, args.params, slots, args.rounds)
        finally:
            links.close()
        raws = []
        for _ in range(args.rounds):
            links = Links(args.workers, args.rate)
            try:
                raws.append(raw_round(links, run["up"], run["down"]))
            finally:
                links.close()
        round_s, raw_s = statistics.median(run["round_s"]), statistics.median(raws)
        ideal = (run["up"] + run["down"]) / (args.rate * MB)
        row = {
            "slots": slots,
            "round_s": round_s,
            "rounds": run["round_s"],
            "wire_s": raw_s,
            "wires": raws,
            "rate_bound_s": ideal,
            "efficiency": raw_s / round_s,
            "up_mb": run["up"] / MB,
            "down_mb": run["down"] / MB,
            "last_round_upload_wait_max_s": run["status"].get("last_round_upload_wait_max_s"),
        }
        results.append(row)
        print(
            f"  slots={slots}: round {round_s:.2f} s (rounds {', '.join(f'{x:.2f}' for x in run['round_s'])}); "
            f"wire time {raw_s:.2f} s (up {row['up_mb']:.0f} MB + down {row['down_mb']:.0f} MB at "
            f"{args.rate:g} MB/s: {ideal:.2f} s); efficiency {raw_s / round_s:.2f}; longest upload "
            f"wait for a slot in the last round {row['last_round_upload_wait_max_s']} s",
            flush=True,
        )
    print()
    print("| upload slots | round s, median | wire time s | efficiency (wire / round) |")
    print("|---|---|---|---|")
    for r in results:
        print(f"| {r['slots']} | {r['round_s']:.2f} | {r['wire_s']:.2f} | {r['efficiency']:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)
    return 0 if all(math.isfinite(r["round_s"]) for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
