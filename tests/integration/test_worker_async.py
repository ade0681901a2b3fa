"""The unchanged DiLoCoWorker against an async server, and DyLU's sync_every adoption."""

from __future__ import annotations

import threading

import requests
import torch

from diloco import DiLoCoServer, DiLoCoWorker, ServerConfig
from tests.helpers.workers import fake_step, make_model, params_of

TIMEOUT = 10.0


def test_worker_in_async_mode_applies_without_waiting_for_others() -> None:
    # num_workers=2 would hold a sync round 0 forever with one worker; async has no barrier.
    cfg = ServerConfig(port=0, num_workers=2, mode="async", outer_lr=1.0, outer_momentum=0.0)
    with DiLoCoServer(cfg) as server:
        first = make_model(0)
        opt1 = torch.optim.SGD(first.parameters(), lr=1.0)
        second = make_model(0)
        opt2 = torch.optim.SGD(second.parameters(), lr=1.0)
        w1 = DiLoCoWorker(
            first, opt1, server.address, sync_every=2, heartbeat_interval=0, bf16_comm=False
        ).start()
        w2 = DiLoCoWorker(
            second, opt2, server.address, sync_every=2, heartbeat_interval=0, bf16_comm=False
        ).start()
        start = params_of(first)
        fake_step(first, opt1, 0.25)
        fake_step(first, opt1, 0.25)  # applied at once: global = start + 0.5
        assert w1.sync_metrics["rounds"] == 1
        fake_step(second, opt2, 1.0)
        fake_step(second, opt2, 1.0)  # one update stale: global = start + 0.5 + 2
        assert w2.sync_metrics["rounds"] == 1
        got = server.global_params()
        for name, t in start.items():
            torch.testing.assert_close(got[name], t + 2.5)
            torch.testing.assert_close(dict(second.named_parameters())[name].detach(), t + 2.5)
        st = server.status()
        assert st["staleness"]["count"] == 2 and st["staleness"]["max"] == 1
        w1.stop(submit=False)
        w2.stop(submit=False)


def test_worker_adopts_the_dylu_recommendation() -> None:
    cfg = ServerConfig(port=0, num_workers=1, mode="async", dylu=True, dylu_min_sync_every=3)
    with DiLoCoServer(cfg) as server:
        base = f"http://{server.address}"
        r = requests.post(
            f"{base}/register",
            json={"worker_id": "fast", "info": {"sync_every": 50}},
            headers={"X-Diloco-Client": "test"},
            timeout=TIMEOUT,
        )
        assert r.status_code == 200
        # A peer far faster than anything this test can run.
        r = requests.post(
            f"{base}/heartbeat",
            json={"worker_id": "fast", "steps_per_second": 1e9},
            headers={"X-Diloco-Client": "test"},
            timeout=TIMEOUT,
        )
        assert r.status_code == 200
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        adopted = threading.Event()
        worker = DiLoCoWorker(
            model, opt, server.address, sync_every=50, heartbeat_interval=0.02, dylu=True
        )
        original = worker._heartbeats.adopt_recommendation

        def watch(reply: dict) -> None:
            original(reply)
            if worker.sync_every == 3:
                adopted.set()

        worker._heartbeats.adopt_recommendation = watch  # type: ignore[method-assign]
        with worker:
            while not adopted.is_set():
                fake_step(model, opt, 0.01)  # gives the heartbeat a speed to report
                adopted.wait(0.01)
            assert worker.sync_every == 3 and worker.sync_metrics["sync_every"] == 3
            workers = {w["worker_id"]: w for w in server.status()["workers"]}
            assert workers[worker.worker_id]["recommended_sync_every"] == 3
