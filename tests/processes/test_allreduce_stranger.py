"""A stranger against an all-reduce run (issue 26, items 4 and 6): three honest worker processes
(tests/programs/allreduce_honest.py) and a server with a token. At two moments of every quorum
each worker joins (its gloo address just published; its group just built), the stranger, who
has no token, (1) calls every rendezvous op on that quorum's keys (delete, overwrite, read,
wait), and (2) connects to every TCP port the worker listens on (gloo's: a scan finds them),
sending garbage, closing at once, or holding the connection open. Every honest process must
survive, the replicas end bit-identical and finite, and the run reaches its last round: the
worst a stranger may cost is a discarded round."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import psutil
import pytest
import requests
import torch
from safetensors.torch import load_file

from diloco import DiLoCoServer, ServerConfig
from diloco.wire.messages.rendezvous import OPS, encode

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "run-token-26"
ROUNDS = 3
WORKERS = 3
GARBAGE = bytes(range(256)) * 16  # 4 KiB that is no gloo preamble


def listening_ports(pid: int) -> list[int]:
    """The TCP ports a process listens on (what a port scan of its host would find)."""
    return sorted(
        c.laddr.port
        for c in psutil.Process(pid).net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN
    )


class Stranger:
    """No token. ``strike(pid, quorum)``: everything it tries against that worker and quorum;
    what it saw is counted in ``seen``."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.seen: dict[str, int] = {}
        self.held: list[socket.socket] = []
        self._lock = threading.Lock()

    def _count(self, what: str) -> None:
        with self._lock:
            self.seen[what] = self.seen.get(what, 0) + 1

    def strike(self, pid: int, quorum: str | None) -> None:
        if quorum is not None:
            for op in OPS:
                body = {"worker_id": "w0", "quorum_id": quorum, "key": "0/0", "keys": ["0/0"],
                        "value": encode(b"x"), "amount": 1, "expected": "", "desired": ""}  # fmt: skip
                for headers in ({}, {"Authorization": "Bearer guess"}):
                    resp = requests.post(
                        f"http://{self.address}/rendezvous/{op}",
                        json=body,
                        headers={"X-Diloco-Client": "x", **headers},
                        timeout=10,
                    )
                    self._count(f"http {resp.status_code}")
        for port in listening_ports(pid):
            self._count("gloo ports")
            for how in ("garbage", "close", "hold"):
                try:
                    conn = socket.create_connection(("127.0.0.1", port), timeout=2)
                except OSError:
                    self._count(f"{how} refused")
                    continue
                if how == "garbage":
                    try:
                        conn.sendall(GARBAGE)
                    except OSError:
                        self._count("garbage reset")
                    conn.close()
                elif how == "close":
                    conn.close()
                else:
                    self.held.append(conn)  # open until the run ends
                self._count(how)

    def close(self) -> None:
        for conn in self.held:
            conn.close()


@pytest.mark.timeout(240)
def test_a_stranger_costs_at_most_a_discarded_round(tmp_path: Path) -> None:
    config = ServerConfig(
        port=0,
        num_workers=WORKERS,
        allreduce=True,
        token=TOKEN,
        heartbeat_timeout=60.0,
        collective_timeout=5.0,
        auth_failure_limit=0,  # the throttle off: every stranger call reaches the checks
    )
    with DiLoCoServer(config) as srv:
        stranger = Stranger(srv.address)
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "tests.programs.allreduce_honest", srv.address, f"w{i}",
                 TOKEN, str(ROUNDS), str(tmp_path / f"w{i}.safetensors")],
                cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])},
            )  # fmt: skip
            for i in range(WORKERS)
        ]
        finals: dict[int, dict[str, Any]] = {}

        def drive(i: int) -> None:
            proc = procs[i]
            assert proc.stdout is not None and proc.stdin is not None
            for line in proc.stdout:
                event = json.loads(line)
                if "moment" in event:
                    open_quorum = srv.status().get("quorum")
                    stranger.strike(event["pid"], open_quorum["id"] if open_quorum else None)
                    proc.stdin.write("go\n")
                    proc.stdin.flush()
                elif event.get("done"):
                    finals[i] = event

        drivers = [threading.Thread(target=drive, args=(i,)) for i in range(WORKERS)]
        for t in drivers:
            t.start()
        try:
            codes = [p.wait(200) for p in procs]
        finally:
            for p in procs:
                p.kill()
            stranger.close()
        for t in drivers:
            t.join(10)
        status = srv.status()
    discarded = [int(finals[i]["metrics"].get("discarded_rounds", 0)) for i in finals]
    print("stranger saw", stranger.seen, "round", status["round"], "discarded", discarded)
    assert codes == [0] * WORKERS, codes  # no honest process died (-11, -6...)
    assert sorted(finals) == list(range(WORKERS))
    # Nothing a stranger sent reached the store: every call was refused for want of a token.
    assert {k for k in stranger.seen if k.startswith("http")} == {"http 401"}
    assert stranger.seen["gloo ports"] >= WORKERS and stranger.seen["hold"] >= WORKERS
    params = [load_file(tmp_path / f"w{i}.safetensors") for i in range(WORKERS)]
    for name, first in params[0].items():
        assert torch.isfinite(first).all(), name
        assert all(torch.equal(first, other[name]) for other in params[1:]), name
    assert status["round"] == ROUNDS  # every round was made, discarded ones repeated
