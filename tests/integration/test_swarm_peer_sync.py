"""Stage sync wired into the swarm peer (issue 29, part E): ``SwarmPeer(sync_every=H)`` runs a
``DiLoCoWorker`` over its stage, whose hook fires where the stage's optimizer steps (the stage
service's compute thread, the head's driver). Peers in threads of this process, joined through a
real in-process ``diloco server --swarm``; the data plane's small model cut into 3 stages."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

import diloco.swarm.driver as driver_module
from diloco.server.server import DiLoCoServer
from diloco.swarm import Endpoint, StaticRoutes, SwarmPeer
from tests.helpers.servers import ServerFactory
from tests.helpers.swarm import batches, reference
from tests.helpers.swarm_peers import (
    BATCH,
    FAST,
    STAGES,
    AfterRounds,
    params_of,
    peers,
    route_table,
    together,
    unsplit_diloco,
)
from tests.helpers.threads import in_threads

H = 2
"""Inner steps between a stage's syncs."""
STEPS = 6
"""Three rounds of every stage."""
QUIET = 600.0
"""An idle step period no test run reaches: no idle steps unless a test asks for them."""


def swarm_server(make_server: ServerFactory, **config: Any) -> DiLoCoServer:
    # join_timeout 30: a stage's quorum waits for every live replica of it (never goes alone).
    settings = {**FAST, "join_timeout": 30.0, **config}
    return make_server(swarm=True, stages=STAGES, min_replicas=1, token="peer-token", **settings)


def stage_params(*started: SwarmPeer) -> dict[str, torch.Tensor]:
    for p in started:
        if p.service is not None:
            p.service.drain()  # the last step (and its round) ran after the last reply
    return params_of(*(p.module for p in started if p.module is not None))


def assert_equal(have: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert have.keys() == want.keys()
    assert all(torch.equal(have[n], want[n]) for n in want), [
        n for n in want if not torch.equal(have[n], want[n])
    ]


@pytest.mark.timeout(120)
def test_one_replica_per_stage_equals_the_unsplit_model_under_single_process_diloco(
    make_server: ServerFactory,
) -> None:
    """One replica per stage, one driver, fp32, sync every H: after 3 rounds every stage's
    parameters (each peer holding only its own, each stage syncing in its own quorums) and
    every loss are bit-identical to the unsplit model trained by one DiLoCo worker in
    all-reduce mode with the same H and outer step (the outer step is element-wise)."""
    data = batches(STEPS, BATCH)
    want, want_losses = unsplit_diloco(data, H)
    plain = make_plain(data)
    assert any(not torch.equal(want[n], plain[n]) for n in want)  # the outer steps moved it
    server = swarm_server(make_server)
    with peers(server, 1, 2, 0, sync_every=H, idle_step_s=QUIET) as (body, tail, head):
        losses = [head.train_step(x, y) for x, y in data]
        assert_equal(stage_params(head, body, tail), want)
        assert losses == want_losses
        for p in (head, body, tail):
            assert p.worker is not None
            assert p.worker.sync_metrics["rounds"] == STEPS // H
            assert p.worker.sync_metrics["failed_syncs"] == 0
        shown = {s["stage"]: s["rounds_completed"] for s in server.status()["swarm"]["stages"]}
        assert shown == {0: 3, 1: 3, 2: 3}


def make_plain(data: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    from tests.helpers.swarm import make_model

    model = make_model(0)
    reference(model, data)
    return params_of(model)


@pytest.mark.timeout(120)
def test_a_syncing_replica_makes_the_driver_wait_not_fail_over(
    make_server: ServerFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The body replica's round is held open (its optimizer's step blocked) until the driver
    has been answered 503 ``syncing`` and backs off: the driver waits and retries the same
    replica; nothing is rerouted or reported suspect, the replica stays in the route table,
    and the run is still bit-identical to single-process DiLoCo of the unsplit model."""
    data = batches(4, BATCH)
    want, want_losses = unsplit_diloco(data, H)
    backed_off = threading.Event()
    waits: list[float] = []

    class Clock:  # the driver's clock, its back-off seen by the test (then really waited)
        monotonic = staticmethod(time.monotonic)

        @staticmethod
        def sleep(seconds: float) -> None:
            waits.append(seconds)
            backed_off.set()
            time.sleep(seconds)

    monkeypatch.setattr(driver_module, "time", Clock)
    server = swarm_server(make_server)
    with peers(server, 1, 2, 0, sync_every=H, idle_step_s=QUIET) as (body, tail, head):
        assert body.service is not None
        steps = {"n": 0}

        def hold_the_round(*_: Any) -> None:  # runs inside the gate's step: the replica is busy
            steps["n"] += 1
            if steps["n"] == H:
                assert backed_off.wait(30), "the driver never got a 503 syncing"

        body.service.optimizer.register_step_pre_hook(hold_the_round)
        losses = [head.train_step(x, y) for x, y in data]
        assert backed_off.is_set() and waits and all(0 < w <= 1.0 for w in waits)
        stats = head.stats()
        assert stats["busy_waits"] >= 1 and stats["reroutes"] == 0
        assert body.service.stats()["busy"] >= 1
        assert route_table(server)[1] == [body.worker_id]
        assert server.status()["swarm"]["suspects"] == []
        assert_equal(stage_params(head, body, tail), want)
        assert losses == want_losses


@pytest.mark.timeout(120)
@pytest.mark.parametrize("weighting", ["samples", "equal"])
def test_an_idle_replica_takes_part_in_its_stages_rounds_with_weight_zero(
    make_server: ServerFactory, weighting: str
) -> None:
    """Two body replicas; the driver leaves the second out (reported suspect), so no call
    reaches it. Its idle steps bring it to every round of its stage (the quorums wait for every
    live replica), and its weight is 0 (it trained no sample), weighted by samples or equally:
    after each round both replicas hold the bytes of single-process DiLoCo of the unsplit
    model, as if it were not there."""
    data = batches(STEPS, BATCH)
    want, _ = unsplit_diloco(data, H)
    server = swarm_server(make_server, weighting=weighting)
    rounds = AfterRounds()
    quiet = {"idle_step_s": QUIET}
    with together(
        server, 1, 1, 2, 0, sync_every=H,
        options=[quiet, {"idle_step_s": 0.05}, quiet, quiet],
    ) as (busy, idle, tail, head):  # fmt: skip
        for p in (busy, idle):
            rounds.watch(p)
        assert head.routes is not None and idle.service is not None
        routes = head.routes
        # Both body replicas in the head's table first: a table listing the idle one again
        # after the report would bring it back.
        assert routes.wait(lambda: len(routes.endpoints(1)) == 2 and routes.endpoints(2), 30)
        routes.suspect(endpoint(idle), "left out by the test")
        for x, y in data:
            head.train_step(x, y)
        assert_equal(stage_params(head, busy, tail), want)
        assert idle.service.stats()["steps"] == 0 and idle.service.stats()["idle_steps"] >= H
        assert busy.service is not None and busy.service.stats()["steps"] == STEPS
        busy.stop()  # first: the idle replica's next round then forms without waiting for it
    for r in range(1, STEPS // H + 1):
        both = rounds.seen[(1, r)]
        assert len(both) == 2, (r, len(both))
        for n in both[0]:
            assert torch.equal(both[0][n], both[1][n]), (r, n)
    final = rounds.seen[(1, STEPS // H)][0]
    assert_equal(final, {n: want[n] for n in final})


@pytest.mark.timeout(120)
def test_two_replicas_per_stage_and_two_drivers_stay_identical_and_learn(
    make_server: ServerFactory,
) -> None:
    """Two replicas of every stage, two drivers training at once on different data, driver
    ``i`` feeding replica ``i`` of each stage (one driver per replica: see swarm.md): after
    every round of every stage both replicas hold the same bytes, though they trained on
    different batches between rounds, and each driver's loss falls."""
    server = swarm_server(make_server)
    rounds = AfterRounds()
    data = [batches(2, BATCH, seed=1 + i) for i in range(2)]  # seen again and again
    with together(server, 1, 1, 2, 2, 0, 0, sync_every=H, idle_step_s=QUIET) as started:
        for p in started:
            rounds.watch(p)
        heads = started[4:]
        for i, head in enumerate(heads):
            assert head.driver is not None
            head.driver.routes = StaticRoutes(
                {k: [endpoint(started[2 * (k - 1) + i])] for k in (1, 2)}
            )

        def drive(i: int) -> list[float]:
            return [heads[i].train_step(*data[i][s % 2]) for s in range(4 * H)]

        losses = in_threads(2, drive, timeout=100)
        stage_params(*started)
    for curve in losses:
        assert sum(curve[-2:]) < sum(curve[:2]), curve
    for stage in range(STAGES):
        for r in range(1, 5):
            replicas = rounds.seen[(stage, r)]
            assert len(replicas) == 2, (stage, r)
            for n in replicas[0]:
                assert torch.equal(replicas[0][n], replicas[1][n]), (stage, r, n)


def endpoint(peer: SwarmPeer) -> Endpoint:
    assert peer.service is not None
    return Endpoint(f"http://127.0.0.1:{peer.service.port}", "peer-token")
