"""Eviction of silent and stuck workers, driven by a fake clock (no sleeps)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch

from diloco.persistence import latest_checkpoint
from diloco.server.config import ServerConfig
from diloco.server.params.store import ParamStore
from diloco.server.paramserver.coordinator import SyncCoordinator
from diloco.wire.messages import Heartbeat, Register
from tests.helpers.aio import let_loop_run
from tests.helpers.clock import FakeClock


def make(clock: FakeClock, **cfg: object) -> SyncCoordinator:
    cfg.setdefault("join_timeout", 0.0)  # workers here never download: see test_join_deadline
    config = ServerConfig(port=0, num_workers=2, **cfg)  # type: ignore[arg-type]
    store = ParamStore.from_tensors({"w": torch.zeros(2)})
    return SyncCoordinator(config, store, clock=clock)


def test_silent_worker_is_evicted_and_counted() -> None:
    async def scenario() -> None:
        clock = FakeClock()
        coord = make(clock, heartbeat_timeout=120.0)
        coord.membership.register(Register("a"), "h")
        coord.membership.register(Register("b"), "h")
        clock.now += 100
        coord.membership.heartbeat(Heartbeat("b"))
        assert coord.membership.check_health() == []
        clock.now += 30  # a: 130 s silent; b: 30 s
        assert coord.membership.check_health() == ["a"]
        st = coord.status().to_json()
        assert [w["worker_id"] for w in st["workers"]] == ["b"]
        assert st["worker_deaths"] == 1 and st["expected"] == ["b"]

    asyncio.run(scenario())


def test_eviction_releases_the_barrier_at_once() -> None:
    async def scenario() -> None:
        clock = FakeClock()
        coord = make(clock, heartbeat_timeout=60.0)
        coord.membership.register(Register("a"), "h")
        coord.membership.register(Register("b"), "h")
        # b has submitted (recorded directly: the HTTP path is covered elsewhere).
        barrier = coord.barrier
        assert barrier is not None
        barrier.begin_upload("b", "s1")
        barrier.record("b", "s1")
        coord.units[0].sum.add([torch.ones(2)], 1.0)
        clock.now += 61
        coord.membership.heartbeat(Heartbeat("b"))
        coord.membership.check_health()  # a is silent: evicted, the round closes with b alone
        assert coord._closing_tasks
        await coord.settle()
        assert barrier.round == 1
        assert coord.store is not None and coord.store.round == 1

    asyncio.run(scenario())


def test_stuck_loop_is_evicted_even_with_heartbeats() -> None:
    async def scenario() -> None:
        clock = FakeClock()
        coord = make(clock, heartbeat_timeout=120.0, stuck_timeout=300.0)
        coord.membership.register(Register("a"), "h")
        coord.membership.register(Register("b"), "h")
        # a: its thread is alive, its loop hung; b: waiting at the barrier, fine.
        coord.membership.heartbeat(Heartbeat("a", step_age_s=301.0, syncing=False))
        coord.membership.heartbeat(Heartbeat("b", step_age_s=900.0, syncing=True))
        assert coord.membership.check_health() == ["a"]
        assert coord.registry.deaths == 1

    asyncio.run(scenario())


def test_zero_timeouts_disable_eviction() -> None:
    async def scenario() -> None:
        clock = FakeClock()
        coord = make(clock, heartbeat_timeout=0.0, stuck_timeout=0.0)
        coord.membership.register(Register("a"), "h")
        coord.membership.heartbeat(Heartbeat("a", step_age_s=1e6, syncing=False))
        clock.now += 1e6
        assert coord.membership.check_health() == []

    asyncio.run(scenario())


def test_num_workers_grows_with_late_joiners() -> None:
    async def scenario() -> None:
        coord = make(FakeClock())
        for w in ("a", "b", "c"):
            coord.membership.register(Register(w), "h")
        assert coord.barrier.num_workers == 3
        assert coord.barrier.expected == {"a", "b"}  # c joined after round 0 opened

    asyncio.run(scenario())


async def _resumed(tmp_path: Path, clock: FakeClock) -> SyncCoordinator:
    """A run of two workers that closed round 0 and saved, then restarted with nobody back."""
    from tests.helpers.coordinator import HeldBody, submit, upload  # it imports this module

    config = ServerConfig(port=0, num_workers=2, heartbeat_timeout=60.0, save_dir=str(tmp_path))
    coord = SyncCoordinator(config, ParamStore.from_tensors({"w": torch.zeros(4)}), clock=clock)
    for w in ("a", "b"):
        coord.membership.register(Register(w), "h")
        await submit(coord, HeldBody(upload(w, 0, 1.0)))
    await coord.settle()
    assert await coord.save() is not None
    again = SyncCoordinator(config, None, clock=clock)
    ckpt = latest_checkpoint(tmp_path)
    assert ckpt is not None and ckpt.round == 1
    again.restore(ckpt)
    return again


def test_a_resumed_round_opens_with_the_workers_that_came_back(tmp_path: Path) -> None:
    """b finished (or died) while the server was down. The resumed round waits for both workers
    as long as a worker may stay silent, then opens with a alone and closes with its upload."""

    from tests.helpers.coordinator import HeldBody, submit, upload

    async def scenario() -> None:
        clock = FakeClock()
        coord = await _resumed(tmp_path, clock)
        coord.membership.register(Register("a"), "h")
        await submit(coord, HeldBody(upload("a", 1, 1.0)))  # accepted and held, as in round 0
        clock.now += 59
        coord.membership.heartbeat(Heartbeat("a"))
        coord.membership.check_health()
        await let_loop_run()
        st = coord.status().to_json()
        assert (st["round"], st["opened"], st["submitted"]) == (1, False, ["a"])
        clock.now += 2  # the heartbeat timeout has passed since the restart
        assert coord.membership.check_health() == []
        await coord.settle()
        st = coord.status().to_json()
        assert st["round"] == 2 and st["last_round_contributions"] == 1
        assert st["opened"] and st["expected"] == ["a"]

    asyncio.run(scenario())


def test_a_fresh_server_still_waits_for_num_workers(tmp_path: Path) -> None:
    """Round 0 of a new run waits for every worker asked for, however long it takes."""

    async def scenario() -> None:
        clock = FakeClock()
        coord = make(clock, heartbeat_timeout=60.0)
        coord.membership.register(Register("a"), "h")
        for _ in range(3):
            clock.now += 50
            coord.membership.heartbeat(Heartbeat("a"))
            coord.membership.check_health()
        assert coord.status().to_json()["opened"] is False

    asyncio.run(scenario())
