"""All-reduce mode under a fault (issue 19): a worker killed with SIGKILL inside the averaging
all-reduce. The survivors' collective fails at once, the round is discarded (nobody applies a
partial average), and once the dead worker has been silent for two of its heartbeat intervals
(long before its heartbeat timeout evicts it) a quorum of the survivors repeats the round with
the pseudo-gradients they still hold: they end exactly where two workers that never met the
third end."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from diloco import DiLoCoServer, DiLoCoWorker, ServerConfig
from tests.helpers.allreduce import EVERY, PERIODS, ROUNDS, run_streaming, run_workers

pytestmark = pytest.mark.slow

HEARTBEAT_TIMEOUT = 60.0  # the survivors must not wait for it (server/allreduce/suspects.py)


ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(120)
def test_a_worker_killed_inside_the_allreduce_is_left_out_before_its_eviction() -> None:
    config = ServerConfig(
        port=0,
        num_workers=3,
        allreduce=True,
        heartbeat_timeout=HEARTBEAT_TIMEOUT,
        collective_timeout=10.0,
    )
    with DiLoCoServer(config) as srv:
        victim = subprocess.Popen(
            [sys.executable, "-m", "tests.programs.allreduce_victim", srv.address, "w9"],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])},
        )
        killed_at: list[float] = []

        def kill_when_inside() -> None:
            assert victim.stdout is not None
            for line in victim.stdout:
                if json.loads(line).get("inside"):
                    victim.send_signal(signal.SIGKILL)
                    killed_at.append(time.monotonic())
                    return

        killer = threading.Thread(target=kill_when_inside)
        killer.start()
        synced_at: dict[int, list[float]] = {0: [], 1: []}
        registered_then: list[bool] = []

        def note(rank: int, r: int, w: DiLoCoWorker) -> None:
            synced_at[rank].append(time.monotonic())
            if killed_at and len(registered_then) < 2:  # a survivor's first sync after the kill
                ids = [entry["worker_id"] for entry in srv.status()["workers"]]
                registered_then.append("w9" in ids)

        try:
            survivors = run_workers(srv.address, 2, ROUNDS, after_sync=note)
        finally:
            victim.kill()
            victim.wait(10)
            killer.join(10)
        status = srv.status()
    assert killed_at, "the victim never reached the all-reduce"
    # The survivors' next rounds completed while the victim was still registered: they did not
    # wait for its eviction.
    assert registered_then == [True, True]
    for rank in (0, 1):
        assert any(t > killed_at[0] for t in synced_at[rank])
    for _, metrics in survivors:
        assert metrics["discarded_rounds"] >= 1
        assert metrics["rounds"] == ROUNDS and metrics["failed_syncs"] == 0
    for k in survivors[0][0]:
        assert torch.equal(survivors[0][0][k], survivors[1][0][k]), k
    assert status["rounds_discarded"] >= 1
    # The discarded round left no trace: two workers that never met the third end the same.
    with DiLoCoServer(ServerConfig(port=0, num_workers=2, allreduce=True)) as srv:
        clean = run_workers(srv.address, 2, ROUNDS)
    torch.testing.assert_close(survivors[0][0], clean[0][0])



ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(120)
def test_a_worker_killed_inside_a_fragments_allreduce_stalls_the_others_one_heartbeat() -> None:
    """Streaming with overlap: the victim (a real process) is killed inside its first weighted
    all-reduce; the survivors' round fails on their round threads while they train on, is
    discarded, and once the victim is evicted the survivors repeat it. They end with the same
    state, having lost no round to the failure."""
    streaming = {"num_fragments": 2, "overlap_steps": 1, "merge_alpha": 0.5}
    config = ServerConfig(
        port=0, num_workers=3, allreduce=True, heartbeat_timeout=2.0, collective_timeout=10.0
    )
    with DiLoCoServer(config) as srv:
        victim = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.programs.allreduce_victim",
                srv.address,
                "w9",
                json.dumps({"sync_every": EVERY, **streaming}),
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])},
        )
        killed = threading.Event()

        def kill_when_inside() -> None:
            assert victim.stdout is not None
            for line in victim.stdout:
                if json.loads(line).get("inside"):
                    victim.send_signal(signal.SIGKILL)
                    killed.set()
                    return

        killer = threading.Thread(target=kill_when_inside)
        killer.start()
        try:
            survivors = run_streaming(srv.address, 2, **streaming)
        finally:
            victim.kill()
            victim.wait(10)
            killer.join(10)
        status = srv.status()
    assert killed.is_set(), "the victim never reached the all-reduce"
    assert status["rounds_discarded"] >= 1
    for r in survivors:
        assert r["metrics"]["discarded_rounds"] >= 1
    last = max(survivors[0]["states"])
    assert last == max(survivors[1]["states"]) and last >= PERIODS * 2 - 2
    for a, b in zip(survivors[0]["states"][last], survivors[1]["states"][last], strict=True):
        assert torch.equal(a, b)
