"""A worker that registers and never joins (it failed on its way, or the reply to its registration
was lost) leaves the expected set after ``join_timeout``, so it never holds a round for the
heartbeat timeout. Driven through the coordinator with a fake clock (no sleeps)."""

from __future__ import annotations

import asyncio
import logging

import pytest
import torch

from diloco.cli.main import main as cli_main
from diloco.server.config import ServerConfig
from diloco.server.params.store import ParamStore
from diloco.server.paramserver.coordinator import SyncCoordinator
from diloco.wire import aread_layout, encode
from diloco.wire.messages import Heartbeat, Register
from tests.helpers.aio import let_loop_run
from tests.helpers.cli import captured_config
from tests.helpers.clock import FakeClock
from tests.helpers.coordinator import HeldBody, submit, upload


def coordinator(clock: FakeClock, store: ParamStore | None, **cfg: object) -> SyncCoordinator:
    config = ServerConfig(port=0, num_workers=2, heartbeat_timeout=120.0, **cfg)  # type: ignore[arg-type]
    return SyncCoordinator(config, store, clock=clock)


def test_a_ghost_leaves_after_the_join_deadline_and_the_round_closes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def scenario() -> None:
        clock = FakeClock()
        coord = coordinator(clock, ParamStore.from_tensors({"w": torch.zeros(4)}))
        coord.membership.register(Register("a"), "h")
        coord.membership.register(
            Register("ghost"), "h"
        )  # then failed its table check, say, and vanished
        coord.registry.fetching("a")  # GET /global_params?worker_id=a
        await submit(coord, HeldBody(upload("a", 0, 1.0)))
        clock.now += 15
        assert coord.membership.check_health() == []  # not later than the deadline
        await let_loop_run()
        assert coord.status().to_json()["round"] == 0
        clock.now += 0.5
        with caplog.at_level(logging.WARNING, logger="diloco.server.members.membership"):
            assert coord.membership.check_health() == ["ghost"]
        assert "join_timeout" in caplog.text
        await coord.settle()
        st = coord.status().to_json()
        assert st["round"] == 1 and st["last_round_contributions"] == 1
        assert [w["worker_id"] for w in st["workers"]] == ["a"] and st["worker_deaths"] == 1

    asyncio.run(scenario())


def test_a_download_or_a_heartbeat_is_a_join() -> None:
    """A first download of a big model may outlast the deadline many times over."""
    clock = FakeClock()
    coord = coordinator(clock, ParamStore.from_tensors({"w": torch.zeros(4)}))
    coord.membership.register(Register("downloading"), "h")
    coord.membership.register(Register("beating"), "h")
    coord.registry.fetching("downloading")
    coord.membership.heartbeat(Heartbeat("beating"))
    clock.now += 100  # within the heartbeat timeout
    assert coord.membership.check_health() == []


def test_an_initial_upload_under_way_is_no_ghost() -> None:
    """The seeding worker sends the whole model before it can fetch anything; the deadline
    starts again when its upload ends."""

    async def scenario() -> None:
        clock = FakeClock()
        coord = coordinator(clock, None, num_fragments=1)
        coord.membership.register(Register("seed"), "h")
        body = HeldBody(encode({"w": torch.ones(4)}, {"worker_id": "seed"}), held=4)
        layout = await aread_layout(body)
        sending = asyncio.ensure_future(coord.receive_initial(layout, body, "seed"))
        await let_loop_run()
        clock.now += 100
        assert coord.membership.check_health() == []
        body.release.set()
        await sending
        clock.now += 15
        assert coord.membership.check_health() == []
        clock.now += 1  # the upload ended 16 s ago and no download was asked for
        assert coord.membership.check_health() == ["seed"]

    asyncio.run(scenario())


def test_zero_disables_the_join_deadline() -> None:
    clock = FakeClock()
    coord = coordinator(clock, ParamStore.from_tensors({"w": torch.zeros(4)}), join_timeout=0.0)
    coord.membership.register(Register("a"), "h")
    clock.now += 100
    assert coord.membership.check_health() == []


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_a_bad_join_timeout_is_refused(bad: float) -> None:
    with pytest.raises(ValueError, match="join_timeout"):
        ServerConfig(join_timeout=bad)


def test_join_timeout_flag_reaches_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = captured_config(monkeypatch)
    assert cli_main(["server", "--port", "0"]) == 0
    assert cli_main(["server", "--port", "0", "--join-timeout", "4"]) == 0
    assert (seen[0].join_timeout, seen[1].join_timeout) == (15.0, 4.0)
