"""Network namespaces joined by shaped virtual links, for netns_links (root only).

One namespace per worker (``dlnl-w0`` ...) and one for the server (``dlnl-srv``), each joined by
a veth pair to a bridge in a namespace of its own (``dlnl-hub``), addresses 10.77.0.1 (server)
and 10.77.0.11+i (worker i) on 10.77.0.0/24. Nothing is created in the root namespace, so its
interfaces are never touched. Every link is shaped by a ``tbf`` qdisc on the egress of both ends
of its veth (optionally with ``netem`` delay under it). ``NetnsContext`` starts each child of a
``harness.session.Session`` inside its namespace (``setns(2)``, what ``ip netns exec`` does)
before it imports anything; ``check_links`` measures the links with plain sockets.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from benchmarks.harness.report import MB

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


# --- one run at a time ---------------------------------------------------------------------


def take_lock() -> Any:
    """One run at a time: two runs would tear down each other's namespaces."""
    f = open(LOCK, "w")  # noqa: SIM115 (held until the process exits)
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        sys.exit(f"another run holds {LOCK}")
    return f


def unavailable() -> str | None:
    """Why namespaces cannot be made here (not root, no ``ip``/``tc``, no netns support), or
    None when they can."""
    if os.geteuid() != 0:
        return "not root (namespaces, veths and qdiscs need CAP_NET_ADMIN)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"no {' or '.join(missing)} on PATH"
    try:
        sh("ip", "netns", "list")
    except (OSError, RuntimeError) as exc:
        return f"ip netns does not work here: {exc}"
    return None
