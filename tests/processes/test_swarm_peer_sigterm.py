"""SIGTERM of a serving ``diloco swarm-peer --sync-every N`` (stage sync): its stage worker,
started on the main thread, took SIGTERM first (``worker/termination.py``), so the peer's own
handling never runs; the peer must still leave as a peer does: exit status 0, deregistered
(gone from the server's status and routes), and its stage's next round formed without it.

A real ``diloco server --swarm`` in this process (its status read directly), the stage
replicas as ``diloco swarm-peer`` processes, the head in this process driving the steps."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from diloco.server.server import DiLoCoServer
from tests.helpers.servers import ServerFactory
from tests.helpers.swarm import HIDDEN, batches
from tests.helpers.swarm_peers import BATCH, FAST, make_peer, route_table

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tests.programs.swarm_model"
H = 2
WAIT = 60.0


def _peer(server: DiLoCoServer, fits: int) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DILOCO_")}
    env.update(DILOCO_TOKEN="cli-token", PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]))
    argv = [sys.executable, "-m", "diloco", "swarm-peer", "--model", f"{MODEL}:build_stage"]
    argv += ["--stages", "3", "--boundary", str(HIDDEN), "--server", server.address]
    argv += ["--fits", str(fits), "--batch", str(BATCH), "--codec", "fp32", "--sync-every", str(H)]
    return subprocess.Popen(
        [*argv, "--heartbeat-interval", "0.2", "--idle-step-s", "0.2"],
        cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def _until(server: DiLoCoServer, done: Callable[[dict[str, Any]], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not done(st := server.status()):
        assert time.monotonic() < deadline, (what, st["swarm"])
        time.sleep(0.02)


def _stage(st: dict[str, Any], k: int) -> dict[str, Any]:
    return st["swarm"]["stages"][k]  # type: ignore[no-any-return]


def test_sigterm_of_a_syncing_stage_replica_leaves_cleanly_and_its_stage_goes_on(
    make_server: ServerFactory,
) -> None:
    server = make_server(swarm=True, stages=3, min_replicas=1, token="cli-token", **FAST)
    procs = [_peer(server, 1), _peer(server, 1), _peer(server, 2)]
    head = None
    try:
        _until(
            server,
            lambda st: len(_stage(st, 1)["ready"]) == 2 and len(_stage(st, 2)["ready"]) == 1,
            "every replica ready",
        )
        head = make_peer(server, 0).start()
        data = batches(2 * H, BATCH)
        for x, y in data[:H]:
            head.train_step(x, y)  # stage 1's round 1: both replicas in its quorum
        _until(server, lambda st: _stage(st, 1)["round"] >= 1, "stage 1's round 1")
        before = set(_stage(server.status(), 1)["assigned"])
        leaving = procs[1]
        t0 = time.monotonic()
        leaving.send_signal(signal.SIGTERM)  # rounds of weight 0 run every idle step meanwhile
        _, err = leaving.communicate(timeout=WAIT)
        took = time.monotonic() - t0
        assert leaving.returncode == 0, err[-3000:]
        assert took < 10.0, took
        st = server.status()
        [left] = before - set(_stage(st, 1)["assigned"])
        assert left not in {w["worker_id"] for w in st["workers"]}
        assert left not in route_table(server)[1] and len(route_table(server)[1]) == 1
        round_then = _stage(st, 1)["round"]
        for x, y in data[H:]:
            head.train_step(x, y)
        _until(server, lambda st: _stage(st, 1)["round"] > round_then, "stage 1's next round")
        for p in (procs[0], procs[2]):
            assert p.poll() is None  # still serving
    finally:
        if head is not None:
            head.stop()
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.communicate(timeout=30)
