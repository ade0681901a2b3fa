"""SwarmPeer through a real in-process coordinator (``diloco server --swarm``): peers in this
process register, get their stage, build only it, serve it (or drive from the head) and find
each other through the coordinator's route table."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from diloco.server.server import DiLoCoServer
from diloco.swarm import SwarmPeer
from diloco.worker.transport.client import Conflict
from tests.helpers.servers import ServerFactory
from tests.helpers.swarm import HIDDEN, NthForward, batches, make_model, reference
from tests.helpers.swarm_peers import (
    BATCH,
    FAST,
    STAGES,
    build_stage,
    make_peer,
    params_of,
    peers,
    route_table,
)

WAIT = 30.0


def swarm_server(make_server: ServerFactory) -> DiLoCoServer:
    return make_server(swarm=True, stages=STAGES, min_replicas=1, token="peer-token", **FAST)


def test_peers_train_bit_identical_to_the_unsplit_model_and_show_their_bytes(
    make_server: ServerFactory,
) -> None:
    """One replica per stage, fp32, one micro-batch a step: after 4 steps every stage's
    parameters (each peer built only its own) and every loss equal the unsplit model's; the
    route table lists each peer at its stage; /status sums the bytes the peers sent."""
    server = swarm_server(make_server)
    data = batches(4, BATCH)
    want_model = make_model(0)
    want_losses = reference(want_model, data)
    with peers(server, 1, 2, 0) as (body, tail, head):
        assert (body.stage, tail.stage, head.stage) == (1, 2, 0)
        assert head.service is None and body.service is not None  # a head serves nothing
        got = [head.train_step(x, y) for x, y in data]
        for p in (body, tail):
            assert p.service is not None
            p.service.drain()
        assert got == want_losses
        want = params_of(want_model)
        have = params_of(*(p.module for p in (head, body, tail) if p.module is not None))
        assert have.keys() == want.keys()
        assert all(torch.equal(have[n], want[n]) for n in want)
        assert route_table(server) == {
            0: [head.worker_id],
            1: [body.worker_id],
            2: [tail.worker_id],
        }

        for p in (head, body, tail):
            p.beat()
        sent: dict[tuple[int, str], int] = {}
        for p in (head, body, tail):
            for key, counts in p.stats()["sent"].items():
                name, direction = key.rsplit(":", 1)
                b = int(name.split("->")[0])
                sent[(b, direction)] = sent.get((b, direction), 0) + int(counts["bytes"])
        shown = {
            (b["boundary"], b["direction"]): b["bytes"]
            for b in server.status()["swarm"]["boundaries"]
        }
        assert shown == sent
        # fp32 at hidden 32: 128 payload bytes a token plus the header, 4 steps of BATCH tokens,
        # each boundary and direction sent at least once (boundary 1 twice: the head relays it).
        assert len(shown) == 4 and all(v > 4 * BATCH * 4 * HIDDEN for v in shown.values())
    assert route_table(server) == {0: [], 1: [], 2: []}  # every peer left


def test_a_second_body_replica_joins_the_drivers_routes(make_server: ServerFactory) -> None:
    server = swarm_server(make_server)
    with peers(server, 1, 2, 0) as (body, _tail, head):
        assert head.routes is not None
        with peers(server, 1) as (second,):
            urls = {body.service.address, second.service.address}  # type: ignore[union-attr]
            assert head.routes.wait(lambda: {e.url for e in head.routes.endpoints(1)} == urls, WAIT)  # type: ignore[union-attr]
            assert sorted(route_table(server)[1]) == sorted([body.worker_id, second.worker_id])
            head.train_step(*batches(1, BATCH)[0])


def _run(
    make_server: ServerFactory, data: list, *, kill: bool
) -> tuple[list[float], dict[str, torch.Tensor], dict]:
    """3 steps, 2 micro-batches each; with ``kill``, two body replicas and the one serving
    step 0 killed when its 2nd forward arrives (micro-batch 0 already applied there)."""
    server = swarm_server(make_server)
    fault = NthForward(2)
    bodies = 2 if kill else 1
    with peers(server, 2, 0, micro_batch=BATCH // 2) as (tail, head):
        body_peers = [
            make_peer(server, 1, micro_batch=BATCH // 2, hook=fault.for_replica(r)).start()
            for r in range(bodies)
        ]
        try:
            assert head.routes is not None
            assert head.routes.wait(lambda: len(head.routes.endpoints(1)) == bodies, WAIT)  # type: ignore[union-attr]
            killer = None
            if kill:

                def kill_it() -> None:
                    assert fault.reached.wait(WAIT)
                    body_peers[fault.replica].service.stop(abrupt=True)  # type: ignore[union-attr]
                    fault.release()

                killer = threading.Thread(target=kill_it)
                killer.start()
            else:
                fault.release()
            losses = [head.train_step(x, y) for x, y in data]
            if killer is not None:
                killer.join(WAIT)
            survivor = body_peers[1 - fault.replica] if kill else body_peers[0]
            assert survivor.service is not None and tail.service is not None
            survivor.service.drain()
            tail.service.drain()
            modules = [p.module for p in (head, survivor, tail)]
            info = {
                "stats": head.stats(),
                "table": route_table(server),
                "killed": body_peers[fault.replica].worker_id if kill else None,
                "survivor": survivor.worker_id,
                "suspects": head.routes.suspects,
            }
            return losses, params_of(*(m for m in modules if m is not None)), info
        finally:
            for p in body_peers:
                p.stop()


def test_a_killed_body_replica_is_rerouted_with_nothing_lost_and_reported(
    make_server: ServerFactory,
) -> None:
    data = batches(3, BATCH)
    want_losses, want_params, _ = _run(make_server, data, kill=False)
    losses, params, info = _run(make_server, data, kill=True)
    assert losses == want_losses
    assert all(torch.equal(params[n], want_params[n]) for n in want_params)
    assert info["stats"]["reroutes"] >= 1 and info["stats"]["recoveries"] >= 1
    assert len(info["suspects"]) == 1  # the driver left it out locally ...
    assert info["table"][1] == [info["survivor"]]  # ... and the coordinator dropped it


def _wider(k: int, num_stages: int) -> nn.Module:
    stage = build_stage(k, num_stages)
    return nn.Sequential(*stage, nn.Linear(HIDDEN, HIDDEN)) if k == 1 else stage


def test_a_peer_whose_stage_does_not_match_the_table_is_refused_and_leaves_nothing(
    make_server: ServerFactory,
) -> None:
    server = swarm_server(make_server)
    with peers(server, 1) as (good,):
        before = route_table(server)
        bad = make_peer(server, 1, build=_wider)
        with pytest.raises(Conflict) as refused:
            bad.start()
        assert refused.value.status == 409 and "params_mismatch" in str(refused.value.body)
        assert route_table(server) == before == {0: [], 1: [good.worker_id], 2: []}
        workers = server.status()["workers"]
        assert bad.worker_id not in str(workers)  # it left (deregistered)
        bad.stop()  # idempotent


@pytest.mark.parametrize(("field", "value"), [("sync_every", 0), ("idle_step_s", 0.0)])
def test_bad_stage_sync_settings_are_refused_before_anything_runs(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        SwarmPeer(
            build_stage, num_stages=3, server="127.0.0.1:1", optimizer=torch.optim.SGD,
            loss_fn=nn.functional.cross_entropy, boundaries=(HIDDEN,), samples_per_step=1,
            **{field: value},
        )  # fmt: skip


def test_a_peer_binding_every_interface_announces_the_address_it_is_given(
    make_server: ServerFactory,
) -> None:
    """``host="0.0.0.0"`` binds every interface, which no driver can dial: without
    ``announce`` the peer is refused before it registers (nothing in the run); with it, its
    ready names the announced address and a head trains through it."""
    server = swarm_server(make_server)
    with pytest.raises(ValueError, match="announce"):
        make_peer(server, 1, host="0.0.0.0")
    assert route_table(server) == {0: [], 1: [], 2: []}
    with peers(server, 1, 2, 0, host="0.0.0.0", announce="127.0.0.1") as (body, tail, head):
        assert body.address is not None and body.address.startswith("http://127.0.0.1:")
        assert body.service is not None and body.service.host == "0.0.0.0"
        x, y = batches(1, BATCH)[0]
        assert head.train_step(x, y) == reference(make_model(0), [(x, y)])[0]
