"""kill -9 of a worker and of the server: nobody deadlocks, nothing is lost or applied twice."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from diloco import DiLoCoClient, DiLoCoServer, DiLoCoWorker, ServerConfig
from diloco.core import apply_outer_step, default_outer_optimizer
from tests.helpers.procs import ServerProcess

pytestmark = pytest.mark.slow


def initial() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {"weight": torch.randn(3, 4, generator=g), "bias": torch.randn(3, generator=g)}


def model_from(params: dict[str, torch.Tensor]) -> torch.nn.Module:
    model = torch.nn.Linear(4, 3)
    model.load_state_dict(params)
    return model


class RecordingWorker(DiLoCoWorker):
    """Keeps every pseudo-gradient the server accepted, with the round and server instance."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.accepted: list[dict[str, Any]] = []

    def _submit(self, submission_id: str) -> dict[str, Any]:
        pg = {n: self._local.snapshot[n] - p.detach() for n, p in self._local.params.items()}
        reply = super()._submit(submission_id)
        self.accepted.append(
            {"sid": submission_id, "round": reply["round"], "instance": reply["instance"], "pg": pg}
        )
        return reply


def replay(
    init: dict[str, torch.Tensor], records: list[dict[str, Any]], rounds: int
) -> dict[str, torch.Tensor]:
    """The reference: apply, round by round, the contributions of the server instance that
    closed that round (a round lost in a crash was run again by the next instance)."""
    params = [torch.nn.Parameter(init[n].clone(), requires_grad=False) for n in ("weight", "bias")]
    opt = default_outer_optimizer(params)
    for r in range(rounds):
        mine = [rec for rec in records if rec["round"] == r]
        assert mine, f"no accepted contribution recorded for round {r}"
        last = mine[-1]["instance"]
        pgs = {rec["sid"]: rec["pg"] for rec in mine if rec["instance"] == last}
        mean = [sum(pg[n] for pg in pgs.values()) / len(pgs) for n in ("weight", "bias")]
        apply_outer_step(opt, params, mean)
    return {"weight": params[0].detach(), "bias": params[1].detach()}


@pytest.mark.timeout(180)
def test_server_kill9_and_restart_from_save_dir(tmp_path: Path) -> None:
    init = initial()
    save_file(init, str(tmp_path / "init.safetensors"))
    save_dir = tmp_path / "ckpt"
    common = [
        "--num-workers",
        "2",
        "--save-dir",
        str(save_dir),
        "--save-every",
        "1",
        "--poll-timeout",
        "2",
    ]
    server = ServerProcess(
        ["--port", "0", "--init", str(tmp_path / "init.safetensors"), *common],
        tmp_path / "server.log",
    )
    port = server.port
    steps, sync_every, pause_after = 30, 3, 9
    gate = threading.Barrier(3, timeout=60)
    workers: list[RecordingWorker] = []
    errors: list[BaseException] = []
    models = [model_from(init) for _ in range(2)]

    def train(i: int) -> None:
        try:
            model = models[i]
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            # Retries outlast a slow restart (a loaded machine took longer than 12 retries'
            # ~4 s to start the new server, and a third sync failed outright).
            client = DiLoCoClient(
                server.address, retries=40, backoff=0.05, max_backoff=0.5, read_timeout=30
            )
            w = RecordingWorker(
                model,
                opt,
                server.address,
                sync_every=sync_every,
                bf16_comm=False,
                worker_id=f"w{i}",
                heartbeat_interval=0,
                client=client,
            )
            workers.append(w)
            g = torch.Generator().manual_seed(i)
            with w:
                for step in range(steps):
                    if step == pause_after:  # both are between syncs here: nothing in flight
                        gate.wait()
                        gate.wait()
                    for p in model.parameters():
                        p.grad = torch.randn(p.shape, generator=g)
                    opt.step()
                    opt.zero_grad()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=train, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    gate.wait()  # both workers paused after their third sync
    server.kill9()
    gate.wait()  # they train on; their next sync meets a dead server
    deadline = time.monotonic() + 60
    while not all(w.client.retry_count > 0 for w in workers) and time.monotonic() < deadline:
        time.sleep(0.01)
    server = ServerProcess(["--port", str(port), *common], tmp_path / "server.log")
    for t in threads:
        t.join(120)
    assert not errors, errors
    try:
        status = DiLoCoClient(server.address).status()
        assert status["resumed_from"] is not None
        assert all(w.sync_metrics["reconnections"] >= 1 for w in workers)
        rounds = status["round"]
        _, got = DiLoCoClient(server.address).get_global_params()
        expected = replay(init, [r for w in workers for r in w.accepted], rounds)
        for name in expected:
            torch.testing.assert_close(got[name], expected[name])
        # Three rounds before the crash; after it, each worker spends at most two syncs finding
        # the new server (one may fail outright, one re-joins), then every sync is a round.
        assert rounds >= 3 + (steps - pause_after) // sync_every - 2
    finally:
        server.stop()


def _victim(address: str, ready: Any) -> None:
    torch.set_num_threads(1)
    model = model_from(initial())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    w = DiLoCoWorker(
        model, opt, address, sync_every=10**9, worker_id="victim", heartbeat_interval=0.2
    )
    w.start()
    ready.set()
    while True:  # trains forever, never syncs: it dies mid-round
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
        time.sleep(0.01)


@pytest.mark.timeout(120)
def test_worker_kill9_mid_round_releases_survivors() -> None:
    timeout = 2.0
    cfg = ServerConfig(port=0, num_workers=3, heartbeat_timeout=timeout)
    with DiLoCoServer(cfg, initial_params=initial()) as server:
        ctx = multiprocessing.get_context("spawn")
        ready = ctx.Event()
        victim = ctx.Process(target=_victim, args=(server.address, ready), daemon=True)
        victim.start()
        assert ready.wait(60)
        done: list[float] = []
        models = [model_from(initial()) for _ in range(2)]

        def survivor(i: int) -> None:
            opt = torch.optim.SGD(models[i].parameters(), lr=0.1)
            with DiLoCoWorker(
                models[i],
                opt,
                server.address,
                sync_every=2,
                worker_id=f"s{i}",
                heartbeat_interval=0.2,
            ) as w:
                for _ in range(2):
                    for p in models[i].parameters():
                        p.grad = torch.ones_like(p)
                    opt.step()
                done.append(time.monotonic())
                assert w.sync_metrics["rounds"] == 1

        threads = [threading.Thread(target=survivor, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while sorted(server.status()["submitted"]) != ["s0", "s1"] and time.monotonic() < deadline:
            time.sleep(0.01)
        killed_at = time.monotonic()
        os.kill(victim.pid, signal.SIGKILL)
        for t in threads:
            t.join(30)
        assert len(done) == 2
        # Released within the heartbeat timeout plus a margin for the monitor's period.
        assert max(done) - killed_at < timeout + 1.5
        status = server.status()
        assert status["round"] == 1 and status["worker_deaths"] == 1
        victim.join(5)
