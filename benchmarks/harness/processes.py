"""Spawned children: one-off jobs, and children driven one round at a time.

A one-off job (``run_child``, ``ask_child``) runs a function in a spawned child, so that the
parent never imports torch or diloco: writing a model's initial parameters, checking settings
against this checkout's library. A round (``session.Session`` builds on these): every child waits at a ``multiprocessing.Barrier`` with the parent; the parent's arrival
starts it; each child reports ``("round", index, payload)`` on one queue. The parent reads the
server process's CPU time around it (the server is idle before and after), and the children time
their own part, so a round's CPU cost is known without instrumenting the server.
"""

from __future__ import annotations

import os
import queue
import shutil
import sys
import time
from typing import Any

import psutil


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


def cpu_s(proc: psutil.Process) -> float:
    """CPU seconds (user + system, all threads) a process has used so far."""
    t = proc.cpu_times()
    return t.user + t.system


def start_and_collect(
    barrier: Any, inbox: Inbox, server: psutil.Process, n: int, timeout: float, what: str
) -> tuple[dict[int, Any], dict[str, float]]:
    """Release the N clients waiting at ``barrier`` and collect their round reports, with the
    CPU seconds the round cost: the server's, read around it (it is idle before and after), and
    the clients', each timed around its own part."""
    server_cpu0 = cpu_s(server)
    barrier.wait(timeout)
    msgs = inbox.collect("round", n, timeout, what)
    cpu = {
        "server": cpu_s(server) - server_cpu0,
        "workers": sum(m["cpu_s"] for m in msgs.values()),
    }
    return msgs, cpu


def run_child(ctx: Any, target: Any, args: tuple[Any, ...], timeout: float, what: str) -> None:
    """Run ``target(*args)`` in a spawned child and wait for it; raise unless it exits with 0."""
    proc = ctx.Process(target=target, args=args, daemon=True)
    try:
        proc.start()
        proc.join(timeout)
        if proc.exitcode != 0:
            raise RuntimeError(f"{what} failed ({proc.exitcode})")
    finally:
        reap([proc])


def ask_child(ctx: Any, target: Any, args: tuple[Any, ...], timeout: float, what: str) -> Any:
    """Run ``target(pipe_end, *args)`` in a spawned child and return what it sends back."""
    parent_conn, child_conn = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child_conn, *args), daemon=True)
    try:
        proc.start()
        if not parent_conn.poll(timeout):
            raise TimeoutError(f"{what} timed out")
        answer = parent_conn.recv()
        proc.join(30)
    finally:
        reap([proc])
    return answer


def reap(procs: list[Any]) -> None:
    """Terminate what still runs, give all 10 s together to go, then kill the rest."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 10
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(5)


def check_alive(procs: list[Any], what: str) -> None:
    """Fail fast: a child that died would otherwise show up only as a barrier timeout."""
    dead = [p.name for p in procs if not p.is_alive() and p.exitcode not in (0, None)]
    if dead:
        raise RuntimeError(f"{what}: {', '.join(dead)} died")


class Environ:
    """Set environment variables around a spawn (``KEY=VALUE`` strings), then restore them:
    a spawned child takes the parent's environment as it is at ``start()``."""

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


def start_profilers(out_dir: str, n: int, pids: dict[str, int]) -> list[Any]:
    """py-spy (``pip install py-spy``) on some processes for the measured rounds, as collapsed
    stacks (``--format raw``), one file per process and thread (``--threads``)."""
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


def stop_profilers(procs: list[Any]) -> None:
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
