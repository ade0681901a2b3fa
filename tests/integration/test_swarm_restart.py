"""The coordinator restarting under a running swarm (issue 29 item 6): the data plane keeps
running through the drivers' last route table, and every peer is back in the new server's table
after its next heartbeat (410, registered again for its own stage, ready again). A real
in-process ``diloco server --swarm``, stopped, and a new one started on the same port; peers in
threads; heartbeats driven by the test (``SwarmPeer.beat``) at exact moments."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from diloco.server.config import ServerConfig
from diloco.server.server import DiLoCoServer
from diloco.swarm import SwarmPeer
from tests.helpers.servers import ServerFactory
from tests.helpers.swarm import batches, make_model, reference
from tests.helpers.swarm_peers import (
    BATCH,
    FAST,
    STAGES,
    AfterRounds,
    leave_out,
    params_of,
    peers,
    route_table,
    together,
)

SWARM = {"swarm": True, "stages": STAGES, "min_replicas": 1, "token": "peer-token"}


def restarted(server: DiLoCoServer, **config: Any) -> DiLoCoServer:
    """``server`` stopped and a new one (knowing no peer) started on its port."""
    port = server.port
    server.stop()
    return DiLoCoServer(ServerConfig(port=port, **{**SWARM, **FAST, **config})).start()


def wait_for_new_table(head: SwarmPeer, server: DiLoCoServer) -> None:
    """The head's routes hold the new server's table with every stage listed."""
    assert head.routes is not None
    routes = head.routes
    want = route_table(server)
    assert routes.wait(
        lambda: all(len(routes.endpoints(k)) == len(want[k]) for k in range(1, STAGES)), 30
    )


@pytest.mark.timeout(120)
def test_drivers_train_through_a_restart_and_peers_are_back_after_one_heartbeat(
    make_server: ServerFactory,
) -> None:
    """One replica per stage, fp32: a step before the restart, two while the coordinator is
    down (the driver keeps its last table), then the new server knows no one; after one
    heartbeat of each peer every replica is in its table again for its own stage, and the
    steps after it complete. Every loss and the final parameters equal the unsplit model's
    plain training: no step lost or doubled across the restart."""
    data = batches(5, BATCH)
    want_model = make_model(0)
    want_losses = reference(want_model, data)
    server = make_server(**SWARM, **FAST)
    new: DiLoCoServer | None = None
    try:
        with peers(server, 1, 2, 0) as (body, tail, head):
            losses = [head.train_step(*data[0])]
            server.stop()
            losses += [head.train_step(x, y) for x, y in data[1:3]]  # the coordinator is down
            new = restarted(server)
            assert route_table(new) == {0: [], 1: [], 2: []}
            for p in (body, tail, head):
                p.beat()  # 410: registered again for its stage, ready again
                assert p.life is not None and p.life.rejoins == 1
            assert route_table(new) == {
                0: [head.worker_id],
                1: [body.worker_id],
                2: [tail.worker_id],
            }
            assert new.status()["swarm"]["stages"][1]["assigned"] == [body.worker_id]
            wait_for_new_table(head, new)
            losses += [head.train_step(x, y) for x, y in data[3:]]
            have = params_of(*(p.module for p in (head, body, tail) if p.module is not None))
    finally:
        if new is not None:
            new.stop()
    assert losses == want_losses
    want = params_of(want_model)
    assert all(torch.equal(have[n], want[n]) for n in want)


@pytest.mark.timeout(150)
def test_with_stage_sync_a_round_after_the_restart_leaves_both_replicas_identical(
    make_server: ServerFactory,
) -> None:
    """Two body replicas syncing every H steps (the one the driver does not call steps idle,
    at the test's moments), a round of every stage before the restart; the coordinator
    restarts; after one heartbeat of each peer (registered again, each for its stage) the next
    round of every stage completes on the new server, both body replicas hold the same bytes,
    and every replica is in the new table."""
    h = 2
    server = make_server(**SWARM, **{**FAST, "join_timeout": 30.0})
    new: DiLoCoServer | None = None
    data = batches(2 * h, BATCH)
    try:
        with together(server, 1, 1, 2, 0, sync_every=h, idle_step_s=600.0) as started:
            busy, idle, tail, head = started
            assert busy.service is not None and idle.service is not None
            leave_out(head, idle)

            def chunk(steps: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
                for x, y in steps:  # the idle replica's H-th idle step meets busy's round
                    head.train_step(x, y)
                    idle.service.step_idle()  # type: ignore[union-attr]
                for p in (busy, tail):
                    p.service.drain()  # type: ignore[union-attr]

            chunk(data[:h])
            new = restarted(server, join_timeout=30.0)
            for p in started:
                p.beat()
            assert route_table(new) == {
                0: [head.worker_id], 1: sorted([str(busy.worker_id), str(idle.worker_id)]),
                2: [tail.worker_id],
            }  # fmt: skip
            after = AfterRounds()
            for p in (busy, idle):
                after.watch(p)
            wait_for_new_table(head, new)
            leave_out(head, idle)
            chunk(data[h:])
            seen = [v for (stage, _), v in after.seen.items() if stage == 1]
            assert len(seen) == 1 and len(seen[0]) == 2, "one body round after the restart"
            both = seen[0]
            assert all(torch.equal(both[0][n], both[1][n]) for n in both[0])
            rounds = [s["rounds_completed"] for s in new.status()["swarm"]["stages"]]
            assert rounds == [1, 1, 1]
            for p in started:
                p.beat()  # no one was forgotten since: the table stays
            assert sorted(route_table(new)[1]) == sorted([str(busy.worker_id), str(idle.worker_id)])
    finally:
        if new is not None:
            new.stop()


@pytest.mark.timeout(150)
def test_stage_workers_register_again_for_their_own_stage_and_their_peers_say_ready(
    make_server: ServerFactory,
) -> None:
    """The restart falls before any heartbeat: each stage worker's next round gets 410 and
    registers again on its own, asking for its peer's stage (``DiLoCoWorker(stages=)``; a
    fresh server would otherwise fill stage 0 first), while the driver trains through its last
    table (the new server lists no replica yet). At the next heartbeat each peer, taken out of
    the table by that registration, says ready again."""
    h = 2
    server = make_server(**SWARM, **{**FAST, "join_timeout": 30.0})
    new: DiLoCoServer | None = None
    data = batches(2 * h, BATCH)
    try:
        with together(server, 1, 2, 0, sync_every=h, idle_step_s=600.0) as started:
            body, tail, head = started
            for x, y in data[:h]:
                head.train_step(x, y)
            for p in (body, tail):
                p.service.drain()  # type: ignore[union-attr]
            new = restarted(server, join_timeout=30.0)
            for x, y in data[h:]:  # the last step's rounds: 410, registered again
                head.train_step(x, y)
            for p in (body, tail):
                p.service.drain()  # type: ignore[union-attr]
            assigned = {s["stage"]: s["assigned"] for s in new.status()["swarm"]["stages"]}
            assert assigned == {0: [head.worker_id], 1: [body.worker_id], 2: [tail.worker_id]}
            for p in started:
                assert p.worker is not None and p.worker.sync_metrics["reconnections"] == 1
                p.beat()
                assert p.life is not None and p.life.rejoins == 0  # the worker did it
            assert route_table(new) == {
                0: [head.worker_id],
                1: [body.worker_id],
                2: [tail.worker_id],
            }
    finally:
        if new is not None:
            new.stop()
