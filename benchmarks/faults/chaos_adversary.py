"""The faulty parties of chaos_allreduce (issue 26): one extra worker that misbehaves in one way,
or a stranger without the run's token.

A faulty worker is the worker program of ``chaos_allreduce_worker.py`` with ``--fault KIND``
(``install`` below changes what it does from ``--fault-step`` on); the honest workers never
see a flag. The kinds, each a row of issue 26's table:

- ``nan``: from the fault step on its model is NaN after every inner step (a diverged worker);
- ``huge``: from the fault step on, +1e30 is added to its model at every inner step;
- ``weight``: it reports 1e300 samples per step and leaves the weight out of its quorum asks,
  as a client that skips the server's bound would (the run weights by samples);
- ``hijack``: after its first sync past the fault step it claims round + 1000 with a state of
  its own (its snapshot shifted by 1.0, its hash recomputed), once;
- ``join-fails``: every quorum join waits the collective timeout and fails, as behind a
  firewall that drops the peers' connections, while it keeps heartbeating;
- ``commit-death``: at its first completed round past the fault step it passes the commit
  point, applies the step and kills itself (SIGKILL) before reporting.

The stranger (``Stranger``, a thread of the driver) has no token: it sends requests to every
route with a wrong token or none, and connects to every TCP port the worker processes listen
on (their gloo connections, found the way a scanner on the host would, in ``/proc/net/tcp``)
and writes garbage or closes at once.
"""

from __future__ import annotations

import json
import math
import os
import random
import signal
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

KINDS = ("nan", "huge", "weight", "hijack", "join-fails", "commit-death")
"""The faulty workers; ``stranger`` is the driver's."""
ADVERSARIES = (*KINDS, "stranger")
BAD_WORKER = "bad"
"""The faulty worker's id: the driver leaves it out of the honest replicas' checks."""


def install(kind: str, fault_step: int, worker: Any, model: Any, say: Callable[..., None]) -> Any:
    """Make this worker faulty in the ``kind`` way; returns a per-step hook the training loop
    calls after each ``opt.step()`` with the number of steps taken."""
    import torch

    if kind == "join-fails":
        _fail_joins()
    if kind == "commit-death":
        _die_after_commit(worker, fault_step, say)
    if kind in ("join-fails", "weight"):
        say(event="fault", kind=kind)  # faulty from its start
    hijacked = said = False

    def after_step(steps: int) -> None:
        nonlocal hijacked, said
        if steps < fault_step:
            return
        if kind in ("nan", "huge") and not said:
            said = True
            say(event="fault", kind=kind, step=steps)
        if kind == "nan":
            with torch.no_grad():
                for p in model.parameters():
                    p.fill_(math.nan)
        elif kind == "huge":
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1e30)
        elif kind == "hijack" and not hijacked and worker.local_step == 0:
            hijacked = True
            strategy = worker._strategy
            with torch.no_grad():
                for t in strategy._state.tensors():
                    t.add_(1.0)
            strategy._s.base_round += 1000
            strategy._hash = strategy._state.hash()
            say(event="fault", kind=kind, round=strategy._s.base_round, hash=strategy._hash)

    return after_step


def weight_client(base: type) -> type:
    """A client class that leaves the weight out of its quorum asks (``weight`` faults)."""

    class NoWeightClient(base):
        def quorum(self, worker_id: str, **kw: Any) -> dict[str, Any]:
            kw.pop("weight", None)
            return dict(super().quorum(worker_id, **kw))

    return NoWeightClient


def _fail_joins() -> None:
    from diloco.worker.allreduce import collective

    def build(*args: Any, **kwargs: Any) -> Any:
        time.sleep(_timeout(args, kwargs))
        raise collective.QuorumFailed("firewalled", "this member's peers cannot reach it")

    collective.QuorumCollective.build = build  # type: ignore[method-assign]


def _timeout(args: tuple[Any, ...], kwargs: dict[str, Any]) -> float:
    """The collective timeout a join was given (the keyword, or the first float argument)."""
    if "timeout" in kwargs:
        return float(kwargs["timeout"])
    floats = [a for a in args if isinstance(a, float)]
    return floats[0] if floats else 10.0


def _die_after_commit(worker: Any, fault_step: int, say: Callable[..., None]) -> None:
    from diloco.worker.allreduce.quorum_sync import QuorumSync

    report = QuorumSync._report

    def dying_report(self: Any, q: Any, **outcome: Any) -> None:
        if outcome.get("ok") and self._s.total_steps >= fault_step:
            say(event="fault", kind="commit-death", quorum=q.quorum_id, at=time.time())
            os.kill(os.getpid(), signal.SIGKILL)
        report(self, q, **outcome)

    QuorumSync._report = dying_report  # type: ignore[method-assign]


class Stranger(threading.Thread):
    """A party without the token, hammering the server's routes and the workers' ports until
    ``stop`` is set. Counts what it sent and what answered."""

    ROUTES = (
        ("POST", "/quorum"),
        ("POST", "/quorum/outcome"),
        ("POST", "/register"),
        ("POST", "/heartbeat"),
        ("GET", "/status"),
        *(
            ("POST", f"/rendezvous/{op}")
            for op in ("set", "get", "add", "compare_set", "wait", "delete", "count")
        ),
    )

    def __init__(
        self,
        address: str,
        worker_pids: Callable[[], list[int]],
        seed: int,
        open_quorum: Callable[[], str | None] = lambda: None,
    ) -> None:
        super().__init__(daemon=True)
        self.address = address.rstrip("/")
        self.open_quorum = open_quorum  # the quorum a scanner of the dashboard would target
        self.worker_pids = worker_pids
        self.rng = random.Random(seed)
        self.stop = threading.Event()
        self.counts = {"http": 0, "http_accepted": 0, "tcp": 0, "tcp_refused": 0}
        self.accepted: list[str] = []

    def run(self) -> None:
        while not self.stop.wait(0.1):
            self._http()
            self._tcp()

    def quorum_id(self) -> str:
        return self.open_quorum() or "x"

    def _http(self) -> None:
        method, path = self.rng.choice(self.ROUTES)
        body = json.dumps(
            {"worker_id": "w0", "quorum_id": self.quorum_id(), "key": "0", "value": "AAAA"}
        ).encode()
        token = self.rng.choice((None, "guess", "x" * 64))
        req = urllib.request.Request(
            self.address + path, data=body if method == "POST" else None, method=method
        )
        if token is not None:
            req.add_header("Authorization", f"Bearer {token}")
        self.counts["http"] += 1
        try:
            with urllib.request.urlopen(req, timeout=2.0) as reply:
                if path != "/status":  # a status page may be public; a change may not
                    self.counts["http_accepted"] += 1
                    self.accepted.append(f"{method} {path} -> {reply.status}")
        except (urllib.error.URLError, OSError):
            pass

    def _tcp(self) -> None:
        for port in _listening_ports(self.worker_pids()):
            self.counts["tcp"] += 1
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1.0) as s:
                    s.settimeout(1.0)
                    s.sendall(self.rng.randbytes(self.rng.choice((1, 8, 64, 4096))))
            except OSError:
                self.counts["tcp_refused"] += 1


def _listening_ports(pids: list[int]) -> list[int]:
    """TCP ports in LISTEN state whose socket belongs to one of ``pids`` (Linux ``/proc``)."""
    inodes: set[str] = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    link = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
        except OSError:
            continue
    ports = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]  # noqa: SIM115
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                ports.append(int(fields[1].rsplit(":", 1)[1], 16))
    return sorted(set(ports))
