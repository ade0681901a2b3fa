"""Server mode against all-reduce mode on shaped links (issue 19), each party in a network namespace.

A user-space shaping proxy (``shaped_links.py``) can only stand in front of the server; in the
all-reduce mode gloo connects the workers to each other directly, so here the links are real
(virtual) network links, shaped by the kernel:

* one network namespace per worker (``dlnl-w0`` ...) and one for the server (``dlnl-srv``), each
  joined by a veth pair to a bridge in a namespace of its own (``dlnl-hub``), addresses
  10.77.0.1 (server) and 10.77.0.11+i (worker i) on 10.77.0.0/24. Nothing is created in the root
  namespace, so its interfaces (``eth0``, ``lo``, ...) are never touched;
* every link shaped to ``--rate-mb`` MB/s (MB = 10**6 bytes, on the wire: Ethernet, IP and TCP
  headers included) in each direction by a ``tbf`` qdisc on the egress of both ends of its veth
  (the namespace end shapes what it sends, the hub end what it receives), optionally with
  ``--delay-ms`` of one-way delay (``netem`` under the ``tbf``);
* before the runs, plain sockets check the links: one worker's link carries the rate each way at
  once, two workers sending to the server share its one link, and a worker-to-worker path (the
  all-reduce's) carries the rate.

Each process of ``allreduce_round.py``'s harness (its ``Session``: a server child and N worker
children driven one round at a time through barriers, children from ``allreduce_round_children``)
is started inside its namespace: ``NetnsContext`` wraps the ``multiprocessing`` context so that
each child joins its namespace (``setns(2)``, what ``ip netns exec`` does) before it imports
anything. The server binds the server namespace's address; an all-reduce worker's gloo device
binds the address of its route to the server, its own namespace's.

Configurations, each on a fresh server and fresh workers, for every N in ``--workers``:
``server bf16`` (bf16 pseudo-gradients up, fp32 parameters down: the default), ``server fp32``
(``--server-fp32``), ``allreduce fp32`` and ``allreduce bf16`` (``ServerConfig(allreduce=True)``;
the server only forms quorums). A round is ``allreduce_round.py``'s: the slowest worker's
``force_sync()`` after a barrier, no inner steps. Medians over the rounds after the warm-up (the
first round after the join). Bytes on the links are read from the ``tbf`` counters around each
round.

Wire time of a round, P parameters, rate R, N workers:

* server mode: every upload (P x 2 bytes in bf16, x 4 in fp32) passes the server's one link, then
  every download (P x 4 bytes); the downloads cannot start before the last upload is in (a
  synchronous round), so the wire time is N x up / R + N x down / R. Were the two directions
  overlapped (pipelined rounds), max(N x up, N x down) / R would be the bound; it is shown too;
* all-reduce mode (a ring: reduce-scatter, then all-gather): each worker sends and receives
  2 (N-1) / N x payload over its own link, payload = P x 4 (fp32) or P x 2 (bf16) bytes.

Run it as root (namespaces, veths and qdiscs need CAP_NET_ADMIN), from the repository root::

    python benchmarks/netns_links.py --quick        # tiny model, N=2, 1 round: does it work?
    python benchmarks/netns_links.py --params 25e6 --workers 2 4 8 --rounds 4 --server-fp32 \\
        --json benchmarks/results/netns_links_25M.json | tee benchmarks/results/netns_links_25M.txt

Children import ``diloco`` from the parent's ``sys.path`` and ``PYTHONPATH`` (set
``PYTHONPATH=src`` to measure this checkout's code). Namespaces left by an earlier run that died
are removed at the start; everything is removed at the end, on Ctrl-C and on errors too
(``--cleanup`` only removes them). One run at a time (a lock file).
"""

from __future__ import annotations

import argparse
import atexit
import ctypes
import fcntl
import functools
import importlib.util
import json
import multiprocessing as mp
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from allreduce_round import Config, Session, estimate_bytes, fits, use_src
from harness.processes import reap
from harness.report import MB, fmt_mb, machine_info, print_table, summary, write_json
from sync_round_children import ModelShape, choose_shape, write_params_main

PREFIX = "dlnl"  # every namespace of this benchmark, so that leftovers are recognised
HUB = f"{PREFIX}-hub"
SERVER_NS = f"{PREFIX}-srv"
SUBNET = "10.77.0"
SERVER_ADDR = f"{SUBNET}.1"
DEV = "dl0"  # the veth end inside each endpoint namespace
LOCK = f"/run/{PREFIX}.lock"
CLONE_NEWNET = 0x40000000


def worker_ns(i: int) -> str:
    return f"{PREFIX}-w{i}"


def worker_addr(i: int) -> str:
    return f"{SUBNET}.{11 + i}"


# --- the namespaces, links and qdiscs ----------------------------------------------------------


def sh(*cmd: str, check: bool = True) -> str:
    """Run an ``ip``/``tc`` command; its stdout. A failure says which command and why."""
    res = subprocess.run(cmd, capture_output=True, text=True)
    if check and res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {res.stderr.strip() or res.returncode}")
    return res.stdout


def our_namespaces() -> list[str]:
    """This benchmark's namespaces that exist now (from this run or an earlier one)."""
    names = [line.split()[0] for line in sh("ip", "netns", "list").splitlines() if line.strip()]
    return [n for n in names if n.startswith(f"{PREFIX}-")]


def teardown() -> None:
    """Delete every namespace of this benchmark. Deleting a namespace destroys the veth ends in
    it, their peers with them, and their qdiscs; the bridge lives in the hub namespace."""
    for ns in our_namespaces():
        sh("ip", "netns", "del", ns, check=False)


def shape(ns: str, dev: str, rate_mb: float, delay_ms: float) -> None:
    """``tbf`` of ``rate_mb`` MB/s on ``dev``'s egress (and ``netem`` delay under it). The burst
    (2 ms of the rate, at least 64 KiB: one GSO packet) keeps the rate exact over a round; the
    queue holds 20 ms of it, enough for TCP to keep the link busy."""
    rate = rate_mb * MB
    burst = max(64 * 1024, int(rate * 0.002))
    cmd = ["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "handle", "1:", "tbf"]
    sh(*cmd, "rate", f"{int(rate * 8)}bit", "burst", str(burst), "latency", "20ms")
    if delay_ms > 0:
        try:
            sh(
                *("tc", "-n", ns, "qdisc", "replace", "dev", dev, "parent", "1:1", "handle", "10:"),
                *("netem", "delay", f"{delay_ms}ms", "limit", "100000"),
            )
        except RuntimeError as exc:  # e.g. a kernel built without CONFIG_NET_SCH_NETEM
            raise RuntimeError(f"--delay-ms needs the netem qdisc: {exc}") from exc


class Topology:
    """The server's namespace and ``workers`` worker namespaces on one bridge, every link shaped
    both ways. A context manager; removes everything it made (and leftovers) on exit."""

    def __init__(self, workers: int, rate_mb: float, delay_ms: float) -> None:
        self.workers, self.rate_mb, self.delay_ms = workers, rate_mb, delay_ms
        # endpoint namespace -> (its address, the hub's end of its veth)
        self.ends = {SERVER_NS: (SERVER_ADDR, "h-srv")}
        for i in range(workers):
            self.ends[worker_ns(i)] = (worker_addr(i), f"h-w{i}")

    def __enter__(self) -> Topology:
        teardown()
        try:
            self._build()
        except BaseException:
            teardown()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        teardown()

    def _build(self) -> None:
        sh("ip", "netns", "add", HUB)
        sh("ip", "-n", HUB, "link", "add", "dlbr", "type", "bridge")  # STP off: forwards at once
        sh("ip", "-n", HUB, "link", "set", "dlbr", "up")
        for ns, (addr, hub_dev) in self.ends.items():
            sh("ip", "netns", "add", ns)
            sh("ip", "-n", HUB, "link", "add", hub_dev, "type", "veth", "peer", DEV, "netns", ns)
            sh("ip", "-n", HUB, "link", "set", hub_dev, "master", "dlbr", "up")
            sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", DEV)
            sh("ip", "-n", ns, "link", "set", DEV, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            shape(ns, DEV, self.rate_mb, self.delay_ms)  # what this end sends
            shape(HUB, hub_dev, self.rate_mb, self.delay_ms)  # what it receives

    def link_bytes(self) -> dict[str, tuple[int, int]]:
        """Bytes each endpoint has sent (its own ``tbf``) and received (the hub end's) so far,
        frames on the wire (headers included), from the qdisc counters."""

        def sent(ns: str, dev: str) -> int:
            qdiscs = json.loads(sh("tc", "-s", "-j", "-n", ns, "qdisc", "show", "dev", dev))
            return next(int(q["bytes"]) for q in qdiscs if q.get("kind") == "tbf")

        return {ns: (sent(ns, DEV), sent(HUB, hub)) for ns, (_, hub) in self.ends.items()}


# --- entering a namespace -------------------------------------------------------------------


def enter_netns(name: str) -> None:
    """Move the calling thread into network namespace ``name`` (``setns(2)``; a process that
    calls it before starting threads is wholly inside, and sockets keep the namespace they were
    made in)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {name}: {os.strerror(err)}")
    finally:
        os.close(fd)


def run_in_netns(name: str, target: Callable[..., Any], *args: Any) -> None:
    """A spawned child's entry: join the namespace first, then run the harness's target."""
    enter_netns(name)
    target(*args)


class NetnsContext:
    """A ``multiprocessing`` context whose ``Process`` starts its target inside a namespace,
    chosen by the process name ``Session`` gives it: ``diloco-server`` in the server's (its
    ``server_main`` told to bind the namespace's address), ``worker-i`` in worker i's. Everything
    else (pipes, queues, barriers) is the wrapped context's: they are not network objects."""

    def __init__(self, ctx: Any) -> None:
        self._ctx = ctx

    def Process(self, *, target: Any, args: tuple = (), name: str = "", **kw: Any) -> Any:  # noqa: N802
        if name == "diloco-server":
            ns, target = SERVER_NS, functools.partial(target, host=SERVER_ADDR)
        elif name.startswith("worker-"):
            ns = worker_ns(int(name.split("-")[1]))
        else:
            raise ValueError(f"no namespace for a process named {name!r}")
        return self._ctx.Process(target=run_in_netns, args=(ns, target, *args), name=name, **kw)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._ctx, attr)


# --- the link check: plain sockets -----------------------------------------------------------


def call_in_netns(ns: str, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` in a thread of its own that joined ``ns`` (this thread stays where it is):
    used to make sockets, which stay in the namespace they were made in."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            enter_netns(ns)
            box["value"] = fn(*args)
        except BaseException as exc:
            box["error"] = exc

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def transfer(flows: list[tuple[str, str]], nbytes: int) -> list[dict[str, Any]]:
    """Move ``nbytes`` along each flow (source namespace, destination namespace), all at once,
    over TCP; per flow the times of its first and last byte at the receiver."""
    addr = {SERVER_NS: SERVER_ADDR} | {worker_ns(i): worker_addr(i) for i in range(64)}
    listeners = {dst: call_in_netns(dst, socket.create_server, (addr[dst], 0)) for _, dst in flows}
    pairs = []
    for src, dst in flows:
        port = listeners[dst].getsockname()[1]
        out = call_in_netns(src, socket.create_connection, (addr[dst], port))
        pairs.append((out, listeners[dst].accept()[0]))
    for s in listeners.values():
        s.close()
    results: list[dict[str, Any]] = [{} for _ in flows]
    go = threading.Barrier(2 * len(flows))

    def send(sock: socket.socket) -> None:
        chunk = bytes(1 << 20)
        go.wait()
        left = nbytes
        while left > 0:
            left -= sock.send(chunk[: min(left, len(chunk))])
        sock.shutdown(socket.SHUT_WR)

    def receive(sock: socket.socket, res: dict[str, Any]) -> None:
        buf = bytearray(1 << 20)
        got, first = 0, None
        go.wait()
        while n := sock.recv_into(buf):
            first = first or time.monotonic()
            got += n
        res.update(first=first, last=time.monotonic(), bytes=got)

    threads = []
    for (out, into), res in zip(pairs, results, strict=True):
        threads.append(threading.Thread(target=send, args=(out,)))
        threads.append(threading.Thread(target=receive, args=(into, res)))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for out, into in pairs:
        out.close()
        into.close()
    return results


def rate_of(results: list[dict[str, Any]]) -> float:
    """MB/s of these flows together, from the first byte of any to the last byte of all."""
    span = max(r["last"] for r in results) - min(r["first"] for r in results)
    return sum(r["bytes"] for r in results) / span / MB


def check_links(nbytes: int) -> list[dict[str, Any]]:
    """Plain TCP through the links: (1) worker 0 to the server and back at once (each direction
    of a link has the rate), (2) workers 0 and 1 to the server at once (they share its link),
    (3) workers 0 and 1 to each other at once (the all-reduce's paths)."""
    w0, w1 = worker_ns(0), worker_ns(1)
    checks = [
        ("worker 0 <-> server, both ways at once", [(w0, SERVER_NS), (SERVER_NS, w0)], False),
        ("workers 0 and 1 -> server at once", [(w0, SERVER_NS), (w1, SERVER_NS)], True),
        ("worker 0 <-> worker 1, both ways at once", [(w0, w1), (w1, w0)], False),
    ]
    out = []
    for what, flows, shared in checks:
        res = transfer(flows, nbytes)
        rates = [rate_of([r]) for r in res]
        out.append(
            {
                "check": what,
                "per_flow_mb_s": rates,
                "together_mb_s": rate_of(res) if shared else None,
            }
        )
    return out


# --- the diloco rounds ------------------------------------------------------------------------


def wire_seconds(cfg: Config, n: int, params: int, rate_mb: float) -> dict[str, float]:
    """The time the round's payload needs on the links (module docstring)."""
    rate = rate_mb * MB
    if cfg.mode == "server":
        up, down = params * (2 if cfg.bf16 else 4), params * 4
        return {
            "wire_s": n * (up + down) / rate,
            "wire_overlapped_s": max(n * up, n * down) / rate,
            "payload_per_worker_up": up,
            "payload_per_worker_down": down,
        }
    payload = params * (2 if cfg.bf16 else 4)
    ring = 2 * (n - 1) / n * payload
    return {
        "wire_s": ring / rate,
        "wire_overlapped_s": ring / rate,
        "payload_per_worker_up": ring,
        "payload_per_worker_down": ring,
    }


def run_config(
    ctx: NetnsContext,
    topo: Topology,
    cfg: Config,
    n: int,
    shape_: ModelShape,
    params_path: str,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """One configuration on a fresh server and N fresh workers: ``Session``'s rounds, with the
    bytes each link carried read from the qdisc counters around every round."""
    with Session(
        ctx,
        cfg,
        n,
        shape_,
        params_path if cfg.mode == "server" else None,
        args,
        rounds=args.warmup + args.rounds,
    ) as s:
        links = []
        for _ in range(args.warmup + args.rounds):
            before = topo.link_bytes()
            s.round()
            after = topo.link_bytes()
            links.append(
                {ns: [a - b for a, b in zip(after[ns], before[ns], strict=True)] for ns in after}
            )
        d = s.finish()
    measured = [lk for lk, r in zip(links, d["rounds"], strict=True) if not r["warmup"]]
    workers = [worker_ns(i) for i in range(n)]
    d["link_bytes_median"] = {
        "server_in": statistics.median(lk[SERVER_NS][1] for lk in measured),
        "server_out": statistics.median(lk[SERVER_NS][0] for lk in measured),
        "worker_up": statistics.median(
            statistics.mean(lk[w][0] for w in workers) for lk in measured
        ),
        "worker_down": statistics.median(
            statistics.mean(lk[w][1] for w in workers) for lk in measured
        ),
    }
    d["worker_sync_s"] = summary(
        [statistics.median(r["worker_sync_s"]) for r in d["rounds"] if not r["warmup"]]
    )
    d["wire"] = wire_seconds(cfg, n, shape_.numel, args.rate_mb)
    d["ratio"] = d["round_s"]["median"] / d["wire"]["wire_s"]
    d["link_bytes_per_round"] = links
    return d


def write_params(ctx: Any, path: str, shape_: ModelShape, timeout: float) -> None:
    """The server mode's initial parameters, written by a child (the parent imports no torch)."""
    writer = ctx.Process(target=write_params_main, args=(path, shape_), daemon=True)
    try:
        writer.start()
        writer.join(timeout)
        if writer.exitcode != 0:
            raise RuntimeError(f"writing the initial parameters failed ({writer.exitcode})")
    finally:
        reap([writer])


# --- reporting --------------------------------------------------------------------------------


def print_links(checks: list[dict[str, Any]], rate_mb: float) -> None:
    print(f"\nLink check, plain TCP (payload MB/s; the links carry {rate_mb:g} MB/s of frames):")
    print_table(
        ["check", "each flow MB/s", "together MB/s"],
        [
            [
                c["check"],
                " / ".join(f"{r:.1f}" for r in c["per_flow_mb_s"]),
                "-" if c["together_mb_s"] is None else f"{c['together_mb_s']:.1f}",
            ]
            for c in checks
        ],
    )


def print_results(results: list[dict[str, Any]]) -> None:
    print("\nRounds on the shaped links (s; medians over the measured rounds):")
    print_table(
        [
            "mode",
            "comm",
            "N",
            "round s (min-max)",
            "wire s",
            "round / wire",
            "wire s if up and down overlapped",
            "server link MB in / out",
            "worker link MB up / down",
            "rounds ok",
        ],
        [
            [
                d["mode"],
                d["comm"]
                + (" up, fp32 down" if d["mode"] == "server" and d["comm"] == "bf16" else ""),
                str(d["workers"]),
                f"{d['round_s']['median']:.2f} ({d['round_s']['min']:.2f}-{d['round_s']['max']:.2f})",
                f"{d['wire']['wire_s']:.2f}",
                f"{d['ratio']:.2f}",
                f"{d['wire']['wire_overlapped_s']:.2f}",
                f"{fmt_mb(d['link_bytes_median']['server_in'])} / "
                f"{fmt_mb(d['link_bytes_median']['server_out'])}",
                f"{fmt_mb(d['link_bytes_median']['worker_up'])} / "
                f"{fmt_mb(d['link_bytes_median']['worker_down'])}",
                "yes" if d["all_rounds_ok"] else "NO",
            ]
            for d in results
        ],
    )
    ar = [d for d in results if d["mode"] == "allreduce" and d["phases_median"]]
    if ar:
        keys = list(ar[0]["phases_median"])
        print("\nWhere an all-reduce round goes (s; median over workers, then over rounds):")
        print_table(
            ["N", "comm", *keys],
            [
                [str(d["workers"]), d["comm"], *(f"{d['phases_median'][k]:.3f}" for k in keys)]
                for d in ar
            ],
        )
    print("\nCPU seconds per round (medians; the server process, all workers together):")
    print_table(
        ["mode", "comm", "N", "server", "workers"],
        [
            [
                d["mode"],
                d["comm"],
                str(d["workers"]),
                f"{d['cpu_s_median']['server']:.2f}",
                f"{d['cpu_s_median']['workers']:.2f}",
            ]
            for d in results
        ],
    )


# --- main ---------------------------------------------------------------------------------------


def lscpu_model() -> str:
    """The CPU model as ``lscpu`` names it."""
    for line in sh("lscpu", check=False).splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return "?"


def load() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def take_lock() -> Any:
    """One run at a time: two runs would tear down each other's namespaces."""
    f = open(LOCK, "w")  # noqa: SIM115 (held until the process exits)
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        sys.exit(f"another run holds {LOCK}")
    return f


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=float, default=25e6, help="model parameters (default 25e6)")
    ap.add_argument("--workers", type=int, nargs="+", default=[2, 4, 8], help="values of N")
    ap.add_argument("--rounds", type=int, default=4, help="measured rounds (default 4)")
    ap.add_argument("--warmup", type=int, default=1, help="rounds not measured (default 1)")
    ap.add_argument("--rate-mb", type=float, default=50.0, help="link rate, MB/s each way")
    ap.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay per link, ms")
    ap.add_argument("--server-fp32", action="store_true", help="also the server mode in fp32")
    ap.add_argument("--no-allreduce-bf16", action="store_true", help="all-reduce in fp32 only")
    ap.add_argument("--check-mb", type=float, default=100.0, help="MB per flow of the link check")
    ap.add_argument("--no-check", action="store_true", help="skip the link check")
    ap.add_argument("--links-only", action="store_true", help="the link check only")
    ap.add_argument("--max-dim", type=int, default=1024, help="widest square layer (default 1024)")
    ap.add_argument("--server-threads", type=int, default=2, help="torch threads of the server")
    ap.add_argument("--collective-timeout", type=float, default=60.0, help="ServerConfig, s")
    ap.add_argument("--setup-timeout", type=float, default=180.0, help="s (+15 per worker)")
    ap.add_argument("--round-timeout", type=float, default=300.0, help="s per round")
    ap.add_argument("--quick", action="store_true", help="tiny model, N=2, 1 round: a smoke test")
    ap.add_argument("--force", action="store_true", help="run even if memory looks short")
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON")
    ap.add_argument("--verbose", "-v", action="store_true", help="print every round")
    ap.add_argument("--cleanup", action="store_true", help="only remove leftover namespaces")
    args = ap.parse_args(argv)
    if args.quick:
        args.params, args.workers, args.rounds, args.warmup = 2e5, [2], 1, 1
        args.check_mb = min(args.check_mb, 10.0)
    if args.rounds < 1 or args.warmup < 0 or min(args.workers) < 2:
        ap.error("--rounds must be >= 1, --warmup >= 0, every N >= 2")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if os.geteuid() != 0:
        sys.exit("run as root: namespaces, veths and qdiscs need CAP_NET_ADMIN")
    lock = take_lock()
    if args.cleanup:
        teardown()
        return 0
    # Whatever ends the run (an error, Ctrl-C, SIGTERM), the namespaces go: SIGTERM becomes an
    # exception so the finally clauses run; atexit covers an exit between them.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    atexit.register(teardown)

    shape_ = choose_shape(args.params, args.max_dim)
    configs = [Config("server", True, proxied=False)]
    if args.server_fp32:
        configs.append(Config("server", False, proxied=False))
    configs.append(Config("allreduce", False, proxied=False))
    if not args.no_allreduce_bf16:
        configs.append(Config("allreduce", True, proxied=False))
    spec = importlib.util.find_spec("diloco")  # finds, does not import (the parent stays light)
    code = use_src(None) | {"diloco_imported_from": spec.origin if spec else None}
    info = machine_info() | {"lscpu_model": lscpu_model()}
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    print(
        f"{started}; model: {shape_.layers} x Linear({shape_.dim}, {shape_.dim}, bias=False) = "
        f"{shape_.numel:,} params, {fmt_mb(shape_.nbytes)} MB fp32; links {args.rate_mb:g} MB/s "
        f"each way, delay {args.delay_ms:g} ms; N = {', '.join(map(str, args.workers))}; rounds "
        f"{args.warmup} warm-up + {args.rounds} measured",
        flush=True,
    )
    print(f"machine: {info['nproc']} CPUs, {info['ram_gib']} GiB RAM, {info['cpu']}", flush=True)
    print(f"code: {code}", flush=True)
    print(f"load average at start: {load()}", flush=True)

    ctx = mp.get_context("spawn")
    tmp = tempfile.mkdtemp(prefix="netns-links-")
    results: list[dict[str, Any]] = []
    skipped: list[str] = []
    checks = None
    loads = {"start": load()}
    try:
        with Topology(max(max(args.workers), 2), args.rate_mb, args.delay_ms) as topo:
            if not args.no_check:
                checks = check_links(int(args.check_mb * MB))
                print_links(checks, args.rate_mb)
            if not args.links_only:
                params_path = os.path.join(tmp, "init.safetensors")
                write_params(ctx, params_path, shape_, args.setup_timeout)
                for n in sorted(set(args.workers)):
                    for cfg in configs:
                        tag = f"N={n} {cfg.mode} {'bf16' if cfg.bf16 else 'fp32'}"
                        msg = fits(estimate_bytes(n, shape_.nbytes, cfg), tag, args.force)
                        if msg:
                            print(msg, flush=True)
                            skipped.append(msg)
                            continue
                        t = time.monotonic()
                        d = run_config(NetnsContext(ctx), topo, cfg, n, shape_, params_path, args)
                        d["load_after"] = load()
                        print(
                            f"{tag}: round {d['round_s']['median']:.2f} s, wire "
                            f"{d['wire']['wire_s']:.2f} s; took {time.monotonic() - t:.0f} s; "
                            f"load {d['load_after']}",
                            flush=True,
                        )
                        results.append(d)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        lock.close()
    loads["end"] = load()

    if results:
        print_results(results)
        print(
            f"\nWire s: the payload over {args.rate_mb:g} MB/s (server mode: N uploads, then N "
            "downloads, through the server's one link; all-reduce: 2(N-1)/N x payload per "
            "worker link). Link MB: frames counted by the tbf qdiscs (TCP/IP headers included). "
            f"Load average: {loads['start']} at the start, {loads['end']} at the end."
        )
    if args.json:
        write_json(
            args.json,
            {
                "benchmark": "netns_links",
                "date": started,
                "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
                "machine": info,
                "load_average": loads,
                "code": code,
                "model": {"dim": shape_.dim, "layers": shape_.layers, "numel": shape_.numel},
                "rate_mb_s": args.rate_mb,
                "delay_ms": args.delay_ms,
                "warmup_rounds": args.warmup,
                "measured_rounds": args.rounds,
                "round_definition": "max over workers of force_sync() end - min over workers "
                "of its start, after a barrier (zero inner-step time)",
                "link_check": checks,
                "results": results,
                "skipped": skipped,
            },
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
