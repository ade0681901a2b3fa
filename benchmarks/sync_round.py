"""Synchronous DiLoCo rounds on loopback, against the raw-socket limit of the same machine.

For a model of P fp32 parameters (a stack of square bias-free ``nn.Linear`` layers) and N workers:

* the server runs in its own spawned process, loading the initial parameters from a safetensors
  file written to a temporary directory (so no worker uploads them);
* N spawned worker processes each hold the model, an SGD optimizer and a ``DiLoCoWorker``
  (``sync_every`` huge, no heartbeats, one torch thread). Each round they perturb their
  parameters in place (standing in for local training), meet at a ``multiprocessing.Barrier``
  and time ``force_sync()``. A round's wall time runs from the earliest start after the barrier
  to the moment the last worker has adopted the new parameters (``time.monotonic``, which on
  Linux is one system-wide clock, so stamps from different processes compare). A worker that
  is done waits for the others before its checksum and next perturbation, as the raw-socket
  clients below wait: on a shared 2-core machine that work would otherwise slow the
  downloads still running;
* the loopback limit: N plain-socket client processes each send the upload size U to one server
  process, which receives every upload into a preallocated buffer and then sends the download
  size D back to each client. Same bytes, same pattern, no HTTP, no Python-level copies;
* both run side by side: after the warm-ups, each measured DiLoCo round is paired with a raw
  round right before or after it (the order alternates), so that the two see the same load on
  a shared machine, whose speed drifts over minutes. Where both sets of processes would not fit
  in memory at once (or with ``--sequential``), the raw rounds run after all DiLoCo rounds.
  Efficiency is the median raw round over the median DiLoCo round; with pairs, the median of
  the per-pair ratios is printed next to it.

CPU: each worker and raw client reads ``time.process_time()`` around its part of a round; the
parent reads the server process's user + system time (psutil) before the start barrier and once
every client has reported. On a machine whose cores are all busy during a round, the ratio of
the two CPU totals is what the wall-time efficiency follows, and it drifts less with the load.

Peak memory: ``ru_maxrss`` read inside each process at its end (exact), plus psutil polling of
RSS from the parent at ~20 Hz (can miss spikes shorter than the period). The parent never imports
torch, so the fork-before-exec copy of it that every spawned child briefly is stays small.

Usage (from the repository root)::

    .venv/bin/python benchmarks/sync_round.py                      # 100M params; 1, 4, 16 workers
    .venv/bin/python benchmarks/sync_round.py --params 5e6 --workers 1 2 --json out.json

MB below means 10**6 bytes. The targets printed next to the figures: 4 workers within 2x the
loopback limit (efficiency >= 0.5); server peak RSS <= 4.5x the fp32 model size; worker peak RSS
<= 3x.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import platform
import queue
import resource
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

import psutil

MB = 1e6
TARGET_EFFICIENCY = 0.5  # for 4 workers: round time within 2x the loopback limit
TARGET_SERVER_X = 4.5
TARGET_WORKER_X = 3.0
SOCKBUF = 4 * 1024 * 1024


# --- model -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    dim: int
    layers: int

    @property
    def numel(self) -> int:
        return self.dim * self.dim * self.layers

    @property
    def nbytes(self) -> int:
        return 4 * self.numel


def choose_shape(params: float, max_dim: int) -> ModelShape:
    """Square layers: at most ``max_dim`` wide, at least 4 layers when the model allows it."""
    dim = max(8, min(max_dim, int(math.sqrt(params / 4))))
    layers = max(1, round(params / (dim * dim)))
    return ModelShape(dim, layers)


def build_model(shape: ModelShape, seed: int = 0) -> Any:
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(
        *[torch.nn.Linear(shape.dim, shape.dim, bias=False) for _ in range(shape.layers)]
    )


def _base_rss() -> int:
    """RSS of a process that has imported torch and diloco and built one (tiny) torch optimizer:
    the first optimizer imports torch._dynamo and friends (~800 modules, ~75 MB), a cost of
    torch that every training process pays, whatever the model size."""
    import torch

    torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    return _rss()


def _rss() -> int:
    return psutil.Process().memory_info().rss


def _cpu_s(proc: psutil.Process) -> float:
    """CPU seconds (user + system, all threads) a process has used so far."""
    t = proc.cpu_times()
    return t.user + t.system


def _start_and_collect(
    barrier: Any, inbox: Inbox, server: psutil.Process, n: int, timeout: float, what: str
) -> tuple[dict[int, Any], dict[str, float]]:
    """Release the N clients waiting at ``barrier`` and collect their round reports, with the
    CPU seconds the round cost: the server's, read around it (it is idle before and after), and
    the clients', each timed around its own part."""
    server_cpu0 = _cpu_s(server)
    barrier.wait(timeout)
    msgs = inbox.collect("round", n, timeout, what)
    cpu = {
        "server": _cpu_s(server) - server_cpu0,
        "workers": sum(m["cpu_s"] for m in msgs.values()),
    }
    return msgs, cpu


def _maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


# --- child processes: parameter file, server, workers -----------------------------------------


def _write_params_main(path: str, shape: ModelShape) -> None:
    import torch
    from safetensors.torch import save_file

    torch.set_num_threads(1)
    model = build_model(shape)
    save_file({n: p.detach().contiguous() for n, p in model.named_parameters()}, path)


def _server_main(
    conn: Any,
    num_workers: int,
    params_path: str,
    threads: int,
    save_every: int = 0,
    server_src: str | None = None,
) -> None:
    import torch

    if threads > 0:
        torch.set_num_threads(threads)
    if server_src:  # another checkout's server (an A/B in one run); the workers stay this one's
        sys.path.insert(0, server_src)
    from diloco.server import DiLoCoServer, ServerConfig

    save_dir = tempfile.mkdtemp(prefix="sync-round-ckpt-") if save_every else None

    base_rss = _base_rss()
    config = ServerConfig(
        host="127.0.0.1",
        port=0,
        num_workers=num_workers,
        initial_params=params_path,
        # The benchmark's workers send no heartbeats; setup of 16 workers can take minutes.
        heartbeat_timeout=0,
        stuck_timeout=0,
        # Durable rounds: each checkpoint written before its round is sent (keep 1: one on disk).
        save_dir=save_dir,
        save_every=save_every,
        keep_checkpoints=1,
    )
    if save_dir is not None:
        import diloco.server as where

        print(f"server: {where.__file__}, checkpoints every {save_every} round(s)", flush=True)
    server = DiLoCoServer(config).start()
    conn.send(
        {"address": server.address, "base_rss": base_rss, "rss_loaded": _rss(), "pid": os.getpid()}
    )
    try:
        while True:
            try:
                cmd = conn.recv()
            except EOFError:  # the parent went away
                return
            if cmd == "status":
                conn.send(server.status())
            elif cmd == "stop":
                status = server.status()
                conn.send({"status": status, "maxrss": _maxrss(), "rss_end": _rss()})
                return
    finally:
        server.stop(timeout=10)
        if save_dir is not None:
            shutil.rmtree(save_dir, ignore_errors=True)


def _worker_main(
    idx: int,
    address: str,
    shape: ModelShape,
    bf16: bool,
    total_rounds: int,
    barrier: Any,
    finished: Any,
    out: Any,
    barrier_timeout: float,
) -> None:
    try:
        _worker_body(
            idx, address, shape, bf16, total_rounds, barrier, finished, out, barrier_timeout
        )
    except BaseException as exc:
        out.put(("error", idx, f"{type(exc).__name__}: {exc}"))
        raise


def _worker_body(
    idx: int,
    address: str,
    shape: ModelShape,
    bf16: bool,
    total_rounds: int,
    barrier: Any,
    finished: Any,
    out: Any,
    barrier_timeout: float,
) -> None:
    import torch

    torch.set_num_threads(1)
    from diloco import DiLoCoWorker

    base_rss = _base_rss()
    model = build_model(shape)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(1000 + idx)
    noise = torch.empty(min(shape.dim * shape.dim, 1 << 20))  # 4 MB, so it barely shows in RSS
    stamps: dict[str, float] = {}

    with DiLoCoWorker(
        model,
        optimizer,
        address,
        sync_every=10**9,
        bf16_comm=bf16,
        worker_id=f"bench-{idx}",
        heartbeat_interval=0,
    ) as worker:
        # Benchmark-side instrumentation (instance attributes; the library is untouched):
        # when the upload was answered, and when the download body of the new round began.
        submit = worker.client.submit_pseudogradients
        into = worker._into_snapshot

        def timed_submit(*a: Any, **k: Any) -> Any:
            reply = submit(*a, **k)
            stamps["submitted"] = time.monotonic()
            return reply

        def timed_into(layout: Any) -> Any:
            stamps["body"] = time.monotonic()
            return into(layout)

        worker.client.submit_pseudogradients = timed_submit  # type: ignore[method-assign]
        worker._into_snapshot = timed_into  # type: ignore[method-assign]
        out.put(("ready", idx, {"base_rss": base_rss, "rss_joined": _rss()}))

        for r in range(total_rounds):
            with torch.no_grad():  # stand-in for H local steps: a small change to every weight
                for p in model.parameters():
                    flat = p.view(-1)
                    for start in range(0, flat.numel(), noise.numel()):
                        part = flat[start : start + noise.numel()]
                        noise.normal_(0.0, 1e-3, generator=gen)
                        part.add_(noise[: part.numel()])
            before = worker.sync_metrics
            out.put(("prepared", idx, {"round": r}))  # idle from here until the round starts
            barrier.wait(barrier_timeout)
            stamps.clear()
            t0, c0 = time.monotonic(), time.process_time()
            worker.force_sync()
            t1, c1 = time.monotonic(), time.process_time()
            finished.wait(barrier_timeout)
            after = worker.sync_metrics
            with torch.no_grad():
                # fp32 sums (a float64 sum would allocate a float64 copy of each tensor): the
                # same bytes give the same sum, so equal sums say every worker adopted the same
                # parameters.
                checksum = sum(float(p.sum()) for p in model.parameters())
            delta = {k: after[k] - before[k] for k in after if isinstance(after[k], (int, float))}
            out.put(
                (
                    "round",
                    idx,
                    {
                        "round": r,
                        "t0": t0,
                        "t1": t1,
                        "cpu_s": c1 - c0,
                        "submitted": stamps.get("submitted"),
                        "body": stamps.get("body"),
                        "server_round": after["round"],
                        "checksum": checksum,
                        "delta": delta,
                    },
                )
            )
    out.put(("done", idx, {"maxrss": _maxrss(), "rss_end": _rss()}))


# --- raw socket limit ---------------------------------------------------------------------------


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
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    _tune(listener)  # inherited by accepted sockets: the window is sized before the handshake
    listener.bind(("127.0.0.1", 0))
    listener.listen(num_clients)
    conn.send(listener.getsockname()[1])
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
    conn.send({"errors": [repr(e) for e in errors], "maxrss": _maxrss()})


def _raw_client_main(
    idx: int, port: int, up: int, down: int, rounds: int, barrier: Any, out: Any
) -> None:
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
        out.put(("done", idx, {"maxrss": _maxrss()}))
    except BaseException as exc:
        out.put(("error", idx, f"{type(exc).__name__}: {exc}"))
        raise


# --- parent side ---------------------------------------------------------------------------------


class _environ:
    """Set environment variables around a spawn (``--server-env``), then restore them."""

    def __init__(self, pairs: list[str] | None) -> None:
        self.pairs = dict(p.split("=", 1) for p in pairs or [])
        self.saved: dict[str, str | None] = {}

    def __enter__(self) -> None:
        for k, v in self.pairs.items():
            self.saved[k] = os.environ.get(k)
            os.environ[k] = v

    def __exit__(self, *exc: object) -> None:
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _start_profilers(out_dir: str, n: int, pids: dict[str, int]) -> list[Any]:
    """py-spy (``pip install py-spy``) on the server and one worker for the measured rounds,
    as collapsed stacks (``--format raw``), one file per process and thread (``--threads``)."""
    import subprocess

    exe = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    if not os.path.exists(exe):
        print("--profile: py-spy not found; not profiling", flush=True)
        return []
    os.makedirs(out_dir, exist_ok=True)
    procs = []
    for name, pid in pids.items():
        path = os.path.join(out_dir, f"{name}-N{n}.txt")
        cmd = [exe, "record", "--pid", str(pid), "--rate", "200", "--threads", "--idle"]
        cmd += ["--format", "raw", "--output", path, "--nonblocking"]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
    time.sleep(1.0)  # let py-spy attach before the round starts
    return procs


def _stop_profilers(procs: list[Any]) -> None:
    import signal

    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
    for p in procs:
        try:
            p.wait(30)
        except Exception:
            p.kill()
            p.wait(5)


class RssPoller:
    """Polls the RSS of some processes at ~20 Hz; keeps each one's maximum."""

    def __init__(self, period: float = 0.05) -> None:
        self.period = period
        self.peaks: dict[int, int] = {}
        self._procs: dict[int, psutil.Process] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def watch(self, pid: int) -> None:
        with self._lock:
            try:
                self._procs[pid] = psutil.Process(pid)
            except psutil.NoSuchProcess:
                pass

    def __enter__(self) -> RssPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            with self._lock:
                procs = list(self._procs.items())
            for pid, proc in procs:
                try:
                    rss = proc.memory_info().rss
                except psutil.Error:
                    continue
                if rss > self.peaks.get(pid, 0):
                    self.peaks[pid] = rss


def _reap(procs: list[Any]) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 10
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(5)


class Inbox:
    """Messages ``(kind, child index, payload)`` from children. A child may run ahead (its
    "done" can arrive before a slower child's last "round"), so other kinds are kept for later."""

    def __init__(self, q: Any) -> None:
        self.q = q
        self._early: list[tuple[str, int, Any]] = []

    def collect(self, kind: str, count: int, timeout: float, what: str) -> dict[int, Any]:
        """Wait for ``count`` messages of ``kind`` (one per child); raise on any child's error."""
        got: dict[int, Any] = {}
        keep = []
        for msg in self._early:
            if msg[0] == kind and msg[1] not in got:
                got[msg[1]] = msg[2]
            else:
                keep.append(msg)
        self._early = keep
        deadline = time.monotonic() + timeout
        while len(got) < count:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"{what}: {len(got)}/{count} children answered within {timeout:.0f} s"
                )
            try:
                msg_kind, idx, payload = self.q.get(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            if msg_kind == "error":
                raise RuntimeError(f"{what}: child {idx} failed: {payload}")
            if msg_kind == kind and idx not in got:
                got[idx] = payload
            else:
                self._early.append((msg_kind, idx, payload))
        return got


def _check_alive(procs: list[Any], what: str) -> None:
    dead = [p.name for p in procs if not p.is_alive() and p.exitcode not in (0, None)]
    if dead:
        raise RuntimeError(f"{what}: {', '.join(dead)} died")


def _cpu_median(rounds: list[dict[str, Any]]) -> dict[str, float]:
    """Median CPU seconds per measured round: the server's, the clients' together, and both."""
    measured = [r["cpu_s"] for r in rounds if not r["warmup"]]
    return {
        "server": statistics.median(c["server"] for c in measured),
        "workers": statistics.median(c["workers"] for c in measured),
        "total": statistics.median(c["server"] + c["workers"] for c in measured),
    }


def _summary(values: list[float]) -> dict[str, float]:
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
    }


class DiLoCoRun:
    """A server process and N worker processes, driven one round at a time."""

    def __init__(
        self, ctx: Any, n: int, shape: ModelShape, params_path: str, args: argparse.Namespace
    ) -> None:
        self.ctx, self.n, self.shape, self.params_path, self.args = ctx, n, shape, params_path, args
        self.total_rounds = args.warmup + args.rounds
        self.setup_timeout = args.setup_timeout + 15 * n
        self.procs: list[Any] = []
        self.rounds: list[dict[str, Any]] = []
        self.poller = RssPoller()
        self._polling = False
        self._profilers: list[Any] = []

    def __enter__(self) -> DiLoCoRun:
        try:
            self._start()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self._polling:
            self.poller.__exit__()
        _stop_profilers(self._profilers)
        _reap(self.procs)

    def _start(self) -> None:
        ctx, n, args = self.ctx, self.n, self.args
        self.parent_conn, child_conn = ctx.Pipe()
        self.server = ctx.Process(
            target=_server_main,
            args=(
                child_conn,
                n,
                self.params_path,
                args.server_threads,
                args.save_every,
                args.server_src,
            ),
            name="diloco-server",
            daemon=True,
        )
        self.procs.append(self.server)
        self.poller.__enter__()
        self._polling = True
        with _environ(args.server_env):
            self.server.start()
        if not self.parent_conn.poll(self.setup_timeout):
            raise TimeoutError("server did not report its address")
        self.hello = self.parent_conn.recv()
        self.poller.watch(self.hello["pid"])
        self.server_proc = psutil.Process(self.hello["pid"])
        self.barrier = ctx.Barrier(n + 1)  # the workers, and the parent (reads status in between)
        # Workers only: a worker that has adopted the new parameters waits here for the
        # others before its checksum and the next round's perturbation, so that benchmark
        # bookkeeping never competes for the cores with a download still in progress.
        # Held here for the run: a multiprocessing barrier the parent drops is torn down.
        self.finished = finished = ctx.Barrier(n)
        self.inbox = Inbox(ctx.Queue())
        self.workers = [
            ctx.Process(
                target=_worker_main,
                args=(
                    i,
                    self.hello["address"],
                    self.shape,
                    not args.no_bf16,
                    self.total_rounds,
                    self.barrier,
                    finished,
                    self.inbox.q,
                    self.setup_timeout + args.round_timeout,  # the first wait spans setup
                ),
                name=f"worker-{i}",
                daemon=True,
            )
            for i in range(n)
        ]
        self.procs.extend(self.workers)
        for w in self.workers:
            w.start()
            self.poller.watch(w.pid)
        self.ready = self.inbox.collect("ready", n, self.setup_timeout, f"N={n} worker setup")
        self.status = self._server_status()
        self._prepared = -1  # the last round for which every worker said it is prepared

    def settle(self) -> None:
        """Wait until every worker has done its between-round work (checksum, perturbation) and
        sits idle at the start barrier, so that nothing of it overlaps a raw round. After the
        last round there is no next one to prepare: the workers are shutting down."""
        r = len(self.rounds)
        if self._prepared < r < self.total_rounds:
            self.inbox.collect("prepared", self.n, self.args.round_timeout, f"N={self.n} round {r}")
            self._prepared = r

    def _server_status(self) -> dict[str, Any]:
        self.parent_conn.send("status")
        if not self.parent_conn.poll(60):
            raise TimeoutError("server status timed out")
        return self.parent_conn.recv()

    def round(self) -> dict[str, Any]:
        n, args = self.n, self.args
        r = len(self.rounds)
        _check_alive(self.procs, f"N={n} round {r}")
        self.settle()
        if args.profile and r == args.warmup:
            self._profilers = _start_profilers(
                args.profile, n, {"server": self.hello["pid"], "worker0": self.workers[0].pid}
            )
        msgs, cpu = _start_and_collect(
            self.barrier, self.inbox, self.server_proc, n, args.round_timeout, f"N={n} round {r}"
        )
        if r == self.total_rounds - 1:
            _stop_profilers(self._profilers)
            self._profilers = []
        new_status = self._server_status()
        status = self.status
        t0 = min(m["t0"] for m in msgs.values())
        t1 = max(m["t1"] for m in msgs.values())
        sub = [m["submitted"] for m in msgs.values()]
        body = [m["body"] for m in msgs.values()]
        phases = None
        if None not in sub and None not in body:
            phases = {
                "uploads_s": max(sub) - t0,  # until the last upload was answered
                "close_s": max(0.0, min(body) - max(sub)),  # until the first download began
                "downloads_s": t1 - max(max(sub), min(body)),  # until the last worker adopted
            }
        deltas = [m["delta"] for m in msgs.values()]
        checksums = {m["checksum"] for m in msgs.values()}
        server_rounds = {m["server_round"] for m in msgs.values()}
        result = {
            "round": r,
            "warmup": r < args.warmup,
            "t0": t0,
            "wall_s": t1 - t0,
            "start_spread_s": max(m["t0"] for m in msgs.values()) - t0,
            "worker_sync_s": [m["t1"] - m["t0"] for m in msgs.values()],
            "cpu_s": cpu,
            "phases": phases,
            "worker_bytes_up": [d["bytes_up"] for d in deltas],
            "worker_bytes_down": [d["bytes_down"] for d in deltas],
            "worker_rounds": [d["rounds"] for d in deltas],
            "failed_syncs": sum(d["failed_syncs"] for d in deltas),
            "retries": sum(d["retries"] for d in deltas),
            "server_bytes_in": new_status["bytes_in"] - status["bytes_in"],
            "server_bytes_out": new_status["bytes_out"] - status["bytes_out"],
            "server_round": new_status["round"],
            "server_contributions": new_status["last_round_contributions"],
            "server_last_round_time_s": new_status["last_round_time_s"],
            "consistent": len(checksums) == 1 and len(server_rounds) == 1,
        }
        self.rounds.append(result)
        self.status = new_status
        if args.verbose:
            print(f"    N={n} round {r}: {result['wall_s']:.3f} s {phases}", flush=True)
        return result

    def bytes_per_worker(self) -> tuple[int, int]:
        """Upload and download bytes of one worker's sync (median over the rounds so far)."""
        up = statistics.median(b for r in self.rounds for b in r["worker_bytes_up"])
        down = statistics.median(b for r in self.rounds for b in r["worker_bytes_down"])
        return int(up), int(down)

    def finish(self) -> dict[str, Any]:
        n = self.n
        done = self.inbox.collect("done", n, self.setup_timeout, f"N={n} worker shutdown")
        self.parent_conn.send("stop")
        if not self.parent_conn.poll(60):
            raise TimeoutError("server did not answer stop")
        final = self.parent_conn.recv()
        self.server.join(30)
        for w in self.workers:
            w.join(30)
        server_polled = self.poller.peaks.get(self.hello["pid"], 0)
        worker_polled = max((self.poller.peaks.get(w.pid, 0) for w in self.workers), default=0)
        rounds = self.rounds
        measured = [r for r in rounds if not r["warmup"]]
        up, down = self.bytes_per_worker()
        return {
            "workers": n,
            "rounds": rounds,
            "round_s": _summary([r["wall_s"] for r in measured]),
            "cpu_s_median": _cpu_median(rounds),
            "phases_median": (
                {
                    k: statistics.median(r["phases"][k] for r in measured)
                    for k in ("uploads_s", "close_s", "downloads_s")
                }
                if all(r["phases"] for r in measured)
                else None
            ),
            "upload_bytes_per_worker": up,
            "download_bytes_per_worker": down,
            "server_bytes_in_per_round": int(
                statistics.median(r["server_bytes_in"] for r in measured)
            ),
            "server_bytes_out_per_round": int(
                statistics.median(r["server_bytes_out"] for r in measured)
            ),
            "all_rounds_ok": all(
                r["consistent"]
                and r["failed_syncs"] == 0
                and all(x == 1 for x in r["worker_rounds"])
                and r["server_contributions"] == n
                for r in rounds
            ),
            "retries": sum(r["retries"] for r in rounds),
            "server": {
                "maxrss": final["maxrss"],
                "polled_peak_rss": server_polled,
                "base_rss": self.hello["base_rss"],
                "rss_after_load": self.hello["rss_loaded"],
                "rss_end": final["rss_end"],
            },
            "worker": {
                "maxrss": max(d["maxrss"] for d in done.values()),
                "maxrss_each": [done[i]["maxrss"] for i in sorted(done)],
                "polled_peak_rss": worker_polled,
                "base_rss": max(r["base_rss"] for r in self.ready.values()),
                "rss_after_join": max(r["rss_joined"] for r in self.ready.values()),
            },
        }


class LoopbackRun:
    """The raw-socket limit: a plain server process and N client processes, one round at a time."""

    def __init__(self, ctx: Any, n: int, up: int, down: int, args: argparse.Namespace) -> None:
        self.ctx, self.n, self.up, self.down, self.args = ctx, n, up, down, args
        self.total_rounds = args.warmup + args.rounds
        self.procs: list[Any] = []
        self.rounds: list[dict[str, Any]] = []

    def __enter__(self) -> LoopbackRun:
        try:
            self._start()
        except BaseException:
            _reap(self.procs)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        _reap(self.procs)

    def _start(self) -> None:
        ctx, n, args = self.ctx, self.n, self.args
        self.parent_conn, child_conn = ctx.Pipe()
        self.server = ctx.Process(
            target=_raw_server_main,
            args=(child_conn, n, self.up, self.down, self.total_rounds),
            name="raw-server",
            daemon=True,
        )
        self.procs.append(self.server)
        self.server.start()
        if not self.parent_conn.poll(args.setup_timeout):
            raise TimeoutError("raw server did not report its port")
        port = self.parent_conn.recv()
        self.server_proc = psutil.Process(self.server.pid)
        self.barrier = ctx.Barrier(n + 1)
        self.inbox = Inbox(ctx.Queue())
        self.clients = [
            ctx.Process(
                target=_raw_client_main,
                args=(i, port, self.up, self.down, self.total_rounds, self.barrier, self.inbox.q),
                name=f"raw-client-{i}",
                daemon=True,
            )
            for i in range(n)
        ]
        self.procs.extend(self.clients)
        for c in self.clients:
            c.start()
        self.inbox.collect("ready", n, args.setup_timeout, f"loopback N={n} setup")

    def round(self) -> dict[str, Any]:
        n, args = self.n, self.args
        r = len(self.rounds)
        _check_alive(self.procs, f"loopback N={n} round {r}")
        msgs, cpu = _start_and_collect(
            self.barrier,
            self.inbox,
            self.server_proc,
            n,
            args.round_timeout,
            f"loopback N={n} round {r}",
        )
        t0 = min(m["t0"] for m in msgs.values())
        result = {
            "round": r,
            "warmup": r < args.warmup,
            "t0": t0,
            "wall_s": max(m["t1"] for m in msgs.values()) - t0,
            "uploads_sent_s": max(m["sent"] for m in msgs.values()) - t0,
            "cpu_s": cpu,
        }
        self.rounds.append(result)
        if args.verbose:
            print(f"    N={n} loopback round {r}: {result['wall_s']:.3f} s", flush=True)
        return result

    def finish(self) -> dict[str, Any]:
        n, args = self.n, self.args
        self.inbox.collect("done", n, args.setup_timeout, f"loopback N={n} shutdown")
        if not self.parent_conn.poll(60):
            raise TimeoutError("raw server did not finish")
        final = self.parent_conn.recv()
        if final["errors"]:
            raise RuntimeError(f"raw server errors: {final['errors']}")
        self.server.join(30)
        for c in self.clients:
            c.join(30)
        measured = [r for r in self.rounds if not r["warmup"]]
        return {
            "workers": n,
            "upload_bytes": self.up,
            "download_bytes": self.down,
            "rounds": self.rounds,
            "round_s": _summary([r["wall_s"] for r in measured]),
            "cpu_s_median": _cpu_median(self.rounds),
            "throughput_MBps": (n * (self.up + self.down))
            / statistics.median(r["wall_s"] for r in measured)
            / MB,
        }


def run_pair(
    ctx: Any,
    n: int,
    shape: ModelShape,
    params_path: str,
    args: argparse.Namespace,
    interleave: bool,
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """DiLoCo rounds and, unless skipped, the raw-socket limit for the bytes they moved.

    Interleaved (when memory allows both sets of processes at once): after the warm-ups, each
    measured DiLoCo round is paired with a raw round right before or after it (alternating), so
    that both see the same load on a shared machine. Otherwise all DiLoCo rounds, then all raw
    rounds."""
    with DiLoCoRun(ctx, n, shape, params_path, args) as d:
        for _ in range(args.warmup):
            d.round()
        if args.skip_loopback or not interleave:
            for _ in range(args.rounds):
                d.round()
            diloco = d.finish()
            lb_result = None
        else:
            up, down = d.bytes_per_worker()  # from the warm-ups (main insists on one)
            with LoopbackRun(ctx, n, up, down, args) as lb:
                d.settle()
                for _ in range(args.warmup):
                    lb.round()
                for r in range(args.rounds):
                    if r % 2 == 0:
                        lb.round()
                        d.round()
                    else:
                        d.round()
                        d.settle()  # the workers' next perturbation is not part of the raw round
                        lb.round()
                lb_result = lb.finish()
            diloco = d.finish()
    if lb_result is None and not args.skip_loopback:
        up, down = diloco["upload_bytes_per_worker"], diloco["download_bytes_per_worker"]
        with LoopbackRun(ctx, n, up, down, args) as lb:
            for _ in range(args.warmup + args.rounds):
                lb.round()
            lb_result = lb.finish()
    return diloco, lb_result


def machine_info() -> dict[str, Any]:
    cpu = "?"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "nproc": os.cpu_count(),
        "ram_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "cpu": cpu,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def estimate_bytes(n: int, model_bytes: int) -> int:
    """What one configuration is expected to need: the server's buffers (about 4x the model with
    bf16 uploads) and each worker's model plus snapshot, with the interpreter and torch (~300 MB
    per process) on top."""
    overhead = 300 * 2**20
    return int(4 * model_bytes + overhead + n * (2.2 * model_bytes + overhead))


def estimate_loopback_bytes(n: int, model_bytes: int) -> int:
    """The raw-socket processes: the server's receive and send buffers (half a model and a
    model), one model-sized buffer per client, and an interpreter (~40 MB) each."""
    overhead = 40 * 2**20
    return int(1.5 * model_bytes + overhead + n * (model_bytes + overhead))


def paired_efficiency(d: dict[str, Any], lb: dict[str, Any]) -> float:
    """Median over the measured rounds of (raw round time / DiLoCo round time beside it)."""
    ours = [r["wall_s"] for r in d["rounds"] if not r["warmup"]]
    raw = [r["wall_s"] for r in lb["rounds"] if not r["warmup"]]
    return statistics.median(b / a for a, b in zip(ours, raw, strict=True))


def _fmt_mb(b: float) -> str:
    return f"{b / MB:,.0f}"


def print_table(results: list[dict[str, Any]], model_bytes: int) -> None:
    head = (
        "| N | round s median (min-max) | loopback limit s | efficiency | up/worker MB | "
        "down/worker MB | server in/out per round MB | server peak RSS MB (x model) | "
        "worker peak RSS MB (x model) |"
    )
    print(head)
    print("|---" * (head.count("|") - 1) + "|")
    for res in results:
        d, lb = res["diloco"], res["loopback"]
        rs = d["round_s"]
        eff = lb["round_s"]["median"] / rs["median"]
        smax = d["server"]["maxrss"]
        wmax = d["worker"]["maxrss"]
        eff_mark = ""
        if d["workers"] == 4:
            eff_mark = " ok" if eff >= TARGET_EFFICIENCY else " MISS"
        s_mark = " ok" if smax <= TARGET_SERVER_X * model_bytes else " MISS"
        w_mark = " ok" if wmax <= TARGET_WORKER_X * model_bytes else " MISS"
        print(
            f"| {d['workers']} | {rs['median']:.2f} ({rs['min']:.2f}-{rs['max']:.2f}) | "
            f"{lb['round_s']['median']:.2f} | {eff:.2f}{eff_mark} | "
            f"{_fmt_mb(d['upload_bytes_per_worker'])} | {_fmt_mb(d['download_bytes_per_worker'])} | "
            f"{_fmt_mb(d['server_bytes_in_per_round'])} / {_fmt_mb(d['server_bytes_out_per_round'])} | "
            f"{_fmt_mb(smax)} ({smax / model_bytes:.2f}x){s_mark} | "
            f"{_fmt_mb(wmax)} ({wmax / model_bytes:.2f}x){w_mark} |"
        )
    print(
        f"\ntargets: efficiency >= {TARGET_EFFICIENCY} at N=4; server peak <= "
        f"{TARGET_SERVER_X}x model; worker peak <= {TARGET_WORKER_X}x model "
        f"(model = {_fmt_mb(model_bytes)} MB fp32)"
    )
    print("\nDetails (medians of the measured rounds):")
    head2 = (
        "| N | limit measured | paired efficiency | uploads s | close s | downloads s | "
        "loopback: uploads sent s | server peak RSS "
        "polled MB | server RSS base / after load MB | server peak above base (x model) | "
        "worker peak polled MB | worker RSS base MB | worker peak above base (x model) | "
        "rounds ok |"
    )
    print(head2)
    print("|---" * (head2.count("|") - 1) + "|")
    for res in results:
        d, lb = res["diloco"], res["loopback"]
        ph = d["phases_median"] or {}
        lb_sent = statistics.median(r["uploads_sent_s"] for r in lb["rounds"] if not r["warmup"])
        w = d["worker"]
        s = d["server"]
        pairs = paired_efficiency(d, lb) if lb.get("interleaved") else None
        print(
            f"| {d['workers']} | {'beside each round' if lb.get('interleaved') else 'after'} | "
            f"{'-' if pairs is None else f'{pairs:.2f}'} | "
            f"{ph.get('uploads_s', float('nan')):.2f} | "
            f"{ph.get('close_s', float('nan')):.2f} | {ph.get('downloads_s', float('nan')):.2f} | "
            f"{lb_sent:.2f} | {_fmt_mb(s['polled_peak_rss'])} | "
            f"{_fmt_mb(s['base_rss'])} / {_fmt_mb(s['rss_after_load'])} | "
            f"{(s['maxrss'] - s['base_rss']) / model_bytes:.2f}x | "
            f"{_fmt_mb(w['polled_peak_rss'])} | {_fmt_mb(w['base_rss'])} | "
            f"{(w['maxrss'] - w['base_rss']) / model_bytes:.2f}x | "
            f"{'yes' if d['all_rounds_ok'] else 'NO'} |"
        )
    print(
        "\nCPU seconds per round (medians; the server process and the worker or client "
        f"processes, all threads; {os.cpu_count()} cores give at most {os.cpu_count()} CPU "
        "seconds per second of wall time):"
    )
    head3 = "| N | DiLoCo server | DiLoCo workers | DiLoCo total | loopback server | loopback clients | loopback total | ratio |"
    print(head3)
    print("|---" * (head3.count("|") - 1) + "|")
    for res in results:
        d, lb = res["diloco"], res["loopback"]
        dc, lc = d["cpu_s_median"], lb["cpu_s_median"]
        print(
            f"| {d['workers']} | {dc['server']:.2f} | {dc['workers']:.2f} | {dc['total']:.2f} | "
            f"{lc['server']:.2f} | {lc['workers']:.2f} | {lc['total']:.2f} | "
            f"{dc['total'] / lc['total']:.2f} |"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=float, default=100e6, help="model parameters (default 100e6)")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--rounds", type=int, default=3, help="measured rounds (default 3)")
    ap.add_argument("--warmup", type=int, default=1, help="warm-up rounds (default 1)")
    ap.add_argument("--no-bf16", action="store_true", help="upload fp32 pseudo-gradients")
    ap.add_argument("--max-dim", type=int, default=2048, help="widest square layer (default 2048)")
    ap.add_argument("--server-threads", type=int, default=2, help="torch threads of the server")
    ap.add_argument("--setup-timeout", type=float, default=180.0, help="seconds (+15 per worker)")
    ap.add_argument("--round-timeout", type=float, default=600.0, help="seconds per round")
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON")
    ap.add_argument("--force", action="store_true", help="run even if memory looks short")
    ap.add_argument("--skip-loopback", action="store_true", help="do not measure the raw limit")
    ap.add_argument(
        "--sequential",
        action="store_true",
        help="measure the raw limit after all DiLoCo rounds instead of beside each one",
    )
    ap.add_argument("--verbose", "-v", action="store_true", help="print every round")
    ap.add_argument(
        "--save-every",
        type=int,
        default=0,
        help="the server writes a checkpoint every N rounds into a temporary dir (0: none)",
    )
    ap.add_argument(
        "--server-src",
        metavar="DIR",
        help="run the server from this src/ dir (another checkout's code, for an A/B)",
    )
    ap.add_argument(
        "--server-env",
        metavar="KEY=VALUE",
        action="append",
        help="environment of the server process only, e.g. MALLOC_MMAP_THRESHOLD_=131072",
    )
    ap.add_argument(
        "--profile",
        metavar="DIR",
        help="record the server and worker 0 with py-spy during the measured rounds",
    )
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.warmup < 0:
        ap.error("--rounds must be >= 1 and --warmup >= 0")

    shape = choose_shape(args.params, args.max_dim)
    model_bytes = shape.nbytes
    info = machine_info()
    print(
        f"model: {shape.layers} x Linear({shape.dim}, {shape.dim}, bias=False) = "
        f"{shape.numel:,} params, {_fmt_mb(model_bytes)} MB fp32; "
        f"uploads {'fp32' if args.no_bf16 else 'bf16'}; rounds {args.warmup} warm-up + "
        f"{args.rounds} measured",
        flush=True,
    )
    print(f"machine: {info['nproc']} CPUs, {info['ram_gib']} GiB RAM, {info['cpu']}", flush=True)

    ctx = mp.get_context("spawn")
    tmp = tempfile.mkdtemp(prefix="diloco-bench-")
    results: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    try:
        params_path = os.path.join(tmp, "init.safetensors")
        writer = ctx.Process(target=_write_params_main, args=(params_path, shape), daemon=True)
        try:
            writer.start()
            writer.join(args.setup_timeout)
            if writer.exitcode != 0:
                raise RuntimeError(f"writing the initial parameters failed ({writer.exitcode})")
        finally:
            _reap([writer])
        for n in sorted(set(args.workers)):
            need = estimate_bytes(n, model_bytes)
            avail = psutil.virtual_memory().available
            if need > avail - 2**30 and not args.force:
                msg = (
                    f"N={n}: skipped, needs about {need / 2**30:.1f} GiB, "
                    f"{avail / 2**30:.1f} GiB available (use a smaller --params, or --force)"
                )
                print(msg, flush=True)
                skipped.append({"workers": n, "reason": msg})
                continue
            # Both sets of processes at once, if they fit: then each measured DiLoCo round has
            # a raw round beside it, under the same load (see run_pair).
            interleave = (
                not args.sequential
                and args.warmup >= 1
                and need + estimate_loopback_bytes(n, model_bytes) <= avail - 2**30
            )
            what = "DiLoCo rounds" + ("" if args.skip_loopback else " and loopback limit")
            how = ", interleaved" if interleave and not args.skip_loopback else ""
            print(f"N={n}: {what}{how} ...", flush=True)
            t = time.monotonic()
            d, lb = run_pair(ctx, n, shape, params_path, args, interleave)
            print(
                f"N={n}: round median {d['round_s']['median']:.3f} s "
                f"(phases {d['phases_median']}; CPU s {d['cpu_s_median']}), "
                f"took {time.monotonic() - t:.0f} s",
                flush=True,
            )
            if lb is not None:
                lb["interleaved"] = interleave
                print(
                    f"N={n}: loopback median {lb['round_s']['median']:.3f} s "
                    f"(CPU s {lb['cpu_s_median']})",
                    flush=True,
                )
            results.append({"diloco": d, "loopback": lb})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    print()
    complete = [r for r in results if r["loopback"] is not None]
    if complete:
        print_table(complete, model_bytes)
    if args.json:
        doc = {
            "benchmark": "sync_round",
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
            "machine": info,
            "model": {**asdict(shape), "numel": shape.numel, "fp32_bytes": model_bytes},
            "bf16_uploads": not args.no_bf16,
            "warmup_rounds": args.warmup,
            "measured_rounds": args.rounds,
            "targets": {
                "efficiency_at_4": TARGET_EFFICIENCY,
                "server_peak_x": TARGET_SERVER_X,
                "worker_peak_x": TARGET_WORKER_X,
            },
            "results": results,
            "skipped": skipped,
        }
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
