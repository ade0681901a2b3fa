"""A joiner enters the route table only holding its stage's agreed state (issue 29, part H): a
``SwarmPeer`` with stage sync presents the state its worker holds in ``POST /swarm/ready``
(``SwarmPeer._say_ready``) and a real in-process ``diloco server --swarm`` checks it against the
stage's quorums. Peers in threads; the data plane's small model cut into 3 stages; a stage's
second replica joins while the driver trains, so its first quorum is its stage's next round."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from diloco import DiLoCoClient
from diloco.server.server import DiLoCoServer
from diloco.swarm import SwarmPeer
from diloco.wire.messages import RegisterInfo
from diloco.worker.allreduce.quorum_sync import QuorumSync
from diloco.worker.transport.client import Conflict
from tests.helpers.servers import ServerFactory
from tests.helpers.swarm import batches
from tests.helpers.swarm_peers import BATCH, FAST, STAGES, make_peer, params_of, together
from tests.helpers.threads import in_threads

H = 2
"""Inner steps between a stage's syncs."""
QUIET = 600.0
"""No idle steps: a stage's rounds come from the driver's steps only."""
LATE = "late-body"


def swarm_server(make_server: ServerFactory) -> DiLoCoServer:
    # join_timeout 30: a stage's quorum waits for every live replica of it (never goes alone).
    settings = {**FAST, "join_timeout": 30.0}
    return make_server(swarm=True, stages=STAGES, min_replicas=1, token="peer-token", **settings)


def table(server: DiLoCoServer) -> tuple[int, dict[int, list[str]]]:
    """The coordinator's route table now: its version, and peer ids per stage."""
    client = DiLoCoClient(server.address, token=server.config.token)
    try:
        got = client.routes()
    finally:
        client.close()
    return got["version"], {
        s["stage"]: [r["peer_id"] for r in s["replicas"]] for s in got["stages"]
    }


def join_while_training(server: DiLoCoServer, head: SwarmPeer, joiner: SwarmPeer) -> Any:
    """``joiner`` (built with worker id ``LATE``) starts while ``head`` trains ``H`` steps: its
    id is registered for stage 1 first, so the stage's next round (which those steps bring)
    waits for it and is its join. What ``start()`` returned, or the exception it raised."""
    client = DiLoCoClient(server.address, token=server.config.token)
    try:
        assert client.register(LATE, info=RegisterInfo(stages=(1,)))["stage"] == 1
    finally:
        client.close()

    def run(i: int) -> Any:
        if i == 1:
            for x, y in batches(H, BATCH, seed=5):
                head.train_step(x, y)
            return None
        try:
            return joiner.start()
        except Conflict as exc:
            return exc

    return in_threads(2, run, timeout=60)[0]


class Tampering(SwarmPeer):
    """A replica whose stage state changes after its join (a broken receive, a bad disk, an
    edit): it no longer holds what its stage agreed on when it says ready."""

    def _stage_worker(self, opt: torch.optim.Optimizer, start: Any) -> Any:
        worker = super()._stage_worker(opt, start)
        strategy = worker._strategy
        assert isinstance(strategy, QuorumSync)
        with torch.no_grad():
            next(iter(strategy._state.snapshot.values())).add_(0.5)
        return worker


@pytest.mark.timeout(120)
def test_a_joiner_is_listed_holding_the_state_its_stage_agreed(make_server: ServerFactory) -> None:
    """Stage 1 has one replica and agreed states (round 1 done); a second replica joins at the
    stage's round 2 and says ready presenting that state: it is in the route table, and holds
    the same state (round, hash) and parameters as the replica that trained, which the stage's
    quorum agreed on."""
    server = swarm_server(make_server)
    with together(server, 1, 2, 0, sync_every=H, idle_step_s=QUIET) as (body, tail, head):
        for x, y in batches(H, BATCH):
            head.train_step(x, y)
        assert body.service is not None and body.worker is not None
        body.service.drain()  # its round 1 done
        joiner = make_peer(server, 1, worker_id=LATE, sync_every=H, idle_step_s=QUIET)
        try:
            assert join_while_training(server, head, joiner) is joiner
            body.service.drain()  # its round 2 (the joiner's join) done
            _, routes = table(server)
            assert sorted(routes[1]) == sorted([body.worker_id, LATE])
            assert joiner.worker is not None and joiner.module is not None
            held = joiner.worker.held_state()
            assert held is not None and held[0] == 2
            assert held == body.worker.held_state()
            assert body.module is not None
            want, got = params_of(body.module), params_of(joiner.module)
            assert all(torch.equal(want[n], got[n]) for n in want)
        finally:
            joiner.stop()


@pytest.mark.timeout(120)
def test_a_replica_not_holding_an_agreed_state_is_refused_and_changes_nothing(
    make_server: ServerFactory,
) -> None:
    """Stage 1 agreed on states. A joiner whose state was changed after its join is refused
    409 ``unagreed_state``; a replica without stage sync (it presents no state) 409
    ``state_required``. Each leaves (deregistered): the route table keeps its version and
    content, and the stage's trained replica is still listed."""
    server = swarm_server(make_server)
    with together(server, 1, 2, 0, sync_every=H, idle_step_s=QUIET) as (body, tail, head):
        for x, y in batches(H, BATCH):
            head.train_step(x, y)
        assert body.service is not None
        body.service.drain()
        before = table(server)
        assert before[1][1] == [body.worker_id]
        tampered = make_peer(
            server, 1, kind=Tampering, worker_id=LATE, sync_every=H, idle_step_s=QUIET
        )
        refused = join_while_training(server, head, tampered)
        assert isinstance(refused, Conflict), refused
        assert refused.status == 409 and refused.code == "unagreed_state"
        assert table(server) == before
        unsynced = make_peer(server, 1)
        with pytest.raises(Conflict) as no_state:
            unsynced.start()
        assert no_state.value.code == "state_required"
        assert table(server) == before
        workers = str(server.status()["workers"])
        assert LATE not in workers and str(unsynced.worker_id) not in workers
        tampered.stop()
        unsynced.stop()
