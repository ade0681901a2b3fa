"""``diloco swarm-peer`` as processes: a coordinator and three peers, one per stage, train a
few steps; the head leaves when done, the others at SIGTERM, all with exit status 0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from diloco.server.server import DiLoCoServer
from tests.helpers.servers import ServerFactory
from tests.helpers.swarm import HIDDEN
from tests.helpers.swarm_peers import FAST, route_table

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tests.programs.swarm_model"
STEPS = 3


def _peer(server: DiLoCoServer, fits: int, *extra: str) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DILOCO_")}
    env.update(DILOCO_TOKEN="cli-token", PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]))
    argv = [sys.executable, "-m", "diloco", "swarm-peer", "--model", f"{MODEL}:build_stage"]
    argv += ["--stages", "3", "--boundary", str(HIDDEN), "--server", server.address]
    argv += ["--fits", str(fits), "--batch", "16", "--micro-batch", "8", "--codec", "int8"]
    return subprocess.Popen(
        [*argv, "--heartbeat-interval", "0.2", *extra],
        cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def test_three_peer_processes_train_and_leave_cleanly(make_server: ServerFactory) -> None:
    server = make_server(swarm=True, stages=3, min_replicas=1, token="cli-token", **FAST)
    stages = [_peer(server, k) for k in (1, 2)]
    head = _peer(server, 0, "--data", f"{MODEL}:batches", "--steps", str(STEPS))
    try:
        out, err = head.communicate(timeout=120)
        assert head.returncode == 0, err[-3000:]
        assert err.count(" loss ") == STEPS  # one line a step
        for p in stages:
            assert p.poll() is None  # still serving
            p.send_signal(signal.SIGTERM)
        for p in stages:
            _, err = p.communicate(timeout=60)
            assert p.returncode == 0, err[-3000:]
        assert route_table(server) == {0: [], 1: [], 2: []}  # all of them left
    finally:
        for p in (*stages, head):
            if p.poll() is None:
                p.kill()
                p.communicate(timeout=30)
