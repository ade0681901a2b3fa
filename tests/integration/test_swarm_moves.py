"""The only replica of a stage leaving (issue 29 item 6): the coordinator moves a replica of a
stage that has two there, and the moved peer restores the stage's newest checkpoint before it
serves; the driver's step that was waiting for the stage completes. A real in-process
``diloco server --swarm``; peers in threads; heartbeats at the test's moments
(``SwarmPeer.beat``)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import diloco.swarm.peer as peer_module
from diloco.persistence.reading import latest_checkpoint
from diloco.persistence.writing import save_checkpoint
from tests.helpers.servers import ServerFactory
from tests.helpers.swarm import batches
from tests.helpers.swarm_peers import (
    BATCH,
    FAST,
    STAGES,
    leave_out,
    params_of,
    route_table,
    together,
)

SWARM = {"swarm": True, "stages": STAGES, "min_replicas": 1, "token": "peer-token"}


@pytest.fixture
def restored(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, torch.Tensor]]:
    """The parameters of every stage module a moved peer restored, as restored (before it
    trains)."""
    got: list[dict[str, torch.Tensor]] = []
    real = peer_module.restore_stage

    def watched(module: Any, *args: Any, **kwargs: Any) -> Any:
        found = real(module, *args, **kwargs)
        got.append(params_of(module))
        return found

    monkeypatch.setattr(peer_module, "restore_stage", watched)
    return got


@pytest.mark.timeout(120)
def test_a_stages_last_replica_leaving_moves_a_replica_which_restores_its_checkpoint(
    make_server: ServerFactory, tmp_path: Path, restored: list[dict[str, torch.Tensor]]
) -> None:
    """Stage 1 with two replicas, stage 2 with one; a checkpoint of stage 2 under
    ``restore_dir/stage-2`` (written here in the project's layout, as a stage's quorum saves).
    Stage 2's replica leaves while the driver's next step waits for the stage. A body replica
    is told at its next heartbeat (``move_to``; which one is the policy's, unit-tested in
    ``tests/unit/test_swarm_moves.py``: its throughput ranking depends on the beats' timing)
    and moves: its stage 2 holds the checkpoint's bytes when it starts serving, the waiting
    step completes with every micro-batch (the new tail steps on a whole batch), and later
    steps train."""
    server = make_server(**SWARM, **FAST)
    data = batches(8, BATCH)
    body = {"stages": [1, 2], "restore_dir": str(tmp_path)}
    with together(server, 1, 1, 2, 0, options=[body, body, {}, {}]) as started:
        busy, idle, tail, head = started
        assert head.routes is not None and tail.module is not None
        leave_out(head, idle)
        first = [head.train_step(x, y) for x, y in data[:2]]
        for p in started:
            p.beat()  # busy reports its throughput; idle reported none (the slower)
        saved = {n: t + 0.01 for n, t in params_of(tail.module).items()}  # not a fresh build
        opt: dict[str, Any] = {"state": {}, "param_groups": []}
        save_checkpoint(tmp_path / "stage-2", 2, saved, opt, {}, keep=2)
        tail.stop()  # stage 2's only replica leaves: the coordinator moves a body at once
        (chosen,) = server.status()["swarm"]["stages"][2]["assigned"]
        moved, stays = (idle, busy) if chosen == idle.worker_id else (busy, idle)
        assert chosen == moved.worker_id
        assert route_table(server)[2] == []
        waiting: list[float] = []
        step = threading.Thread(target=lambda: waiting.append(head.train_step(*data[2])))
        step.start()
        moved.beat()  # move_to 2: restore, serve, ready
        assert moved.stage == 2 and moved.life is not None and moved.life.moves == 1
        assert len(restored) == 1 and restored[0].keys() == saved.keys()
        assert all(torch.equal(restored[0][n], saved[n]) for n in saved)
        stays.beat()  # a replica left out earlier is listed again after its heartbeat
        step.join(60)
        assert not step.is_alive() and len(waiting) == 1
        assert moved.service is not None and moved.service.stats()["steps"] == 1  # whole batch
        assert route_table(server) == {
            0: [head.worker_id],
            1: [stays.worker_id],
            2: [moved.worker_id],
        }
        later = [head.train_step(x, y) for x, y in data[3:]]
        assert all(torch.isfinite(torch.tensor(first + waiting + later)))
        assert min(later) < waiting[0], (waiting, later)


@pytest.mark.timeout(120)
def test_a_stage_with_agreed_rounds_and_no_checkpoint_is_not_served_by_the_moved_peer(
    make_server: ServerFactory,
) -> None:
    """Stage sync, a round of every stage agreed, no checkpoint anywhere: the moved peer does
    not serve fresh weights as the stage's; it says why (``life.unrestorable``) and the stage
    stays empty in the route table."""
    server = make_server(**SWARM, **{**FAST, "join_timeout": 30.0})
    h = 2
    body = {"stages": [1, 2]}
    with together(
        server, 1, 1, 2, 0, sync_every=h, idle_step_s=600.0, options=[body, body, {}, {}]
    ) as started:
        busy, idle, tail, head = started
        assert head.routes is not None and idle.service is not None
        leave_out(head, idle)
        for x, y in batches(h, BATCH):
            head.train_step(x, y)
            idle.service.step_idle()
        for p in (busy, tail):
            p.service.drain()  # type: ignore[union-attr]
        for p in started:
            p.beat()
        tail.stop()
        idle.beat()
        assert idle.life is not None and idle.life.moves == 0
        assert idle.life.unrestorable is not None and "stage 2" in idle.life.unrestorable
        assert route_table(server)[2] == [] and idle.service is None


@pytest.mark.timeout(120)
def test_a_moved_peer_with_stage_sync_starts_from_the_checkpoints_round_and_serves(
    make_server: ServerFactory, tmp_path: Path, restored: list[dict[str, torch.Tensor]]
) -> None:
    """Stage sync (H = 2) with ``--save-every 1``: every stage's quorum's rank 0 saves under
    ``save_dir/stage-<k>`` (one folder for all the peers here). Stage 2's only replica leaves
    after its first round; the moved body replica restores the checkpoint (its parameters are
    the checkpoint's bytes), its stage worker presents the checkpoint's round and hash (round
    1, the stage's last agreed state) so its join's quorum forms with it as the source (no
    resync), and its ready holding that state is accepted: the driver's waiting step completes
    with a whole batch on the new replica, and the next stage-2 round completes (round 2)."""
    server = make_server(**SWARM, **{**FAST, "join_timeout": 30.0, "save_every": 1})
    h, data = 2, batches(5, BATCH)
    body = {"stages": [1, 2]}
    sync = {"save_dir": str(tmp_path)}
    with together(
        server, 1, 1, 2, 0, sync_every=h, idle_step_s=600.0, sync_options=sync,
        options=[body, body, {}, {}],
    ) as started:  # fmt: skip
        busy, idle, tail, head = started
        assert head.routes is not None and idle.service is not None and tail.worker is not None
        leave_out(head, idle)
        for x, y in data[:h]:
            head.train_step(x, y)
            idle.service.step_idle()
        for p in (busy, tail):
            p.service.drain()  # type: ignore[union-attr]
        agreed = tail.worker.held_state()
        assert agreed is not None and agreed[0] == 1
        saved = latest_checkpoint(tmp_path / "stage-2")
        assert saved is not None and saved.round == 1
        for p in started:
            p.beat()
        tail.stop()  # stage 2's only replica leaves: the coordinator moves idle at once
        assert server.status()["swarm"]["stages"][2]["assigned"] == [idle.worker_id]
        waiting: list[float] = []
        step = threading.Thread(target=lambda: waiting.append(head.train_step(*data[h])))
        step.start()
        idle.beat()  # move_to 2: restore, join from round 1, serve, ready
        assert idle.stage == 2 and idle.life is not None and idle.life.moves == 1
        assert idle.life.unrestorable is None
        assert len(restored) == 1 and restored[0].keys() == saved.params.keys()
        assert all(torch.equal(restored[0][n], saved.params[n]) for n in saved.params)
        moved = idle.worker
        assert moved is not None and moved.sync_metrics["rebases"] == 0  # the source itself
        step.join(60)
        assert not step.is_alive() and len(waiting) == 1
        assert idle.service is not None and idle.service.stats()["steps"] == 1  # a whole batch
        assert route_table(server)[2] == [idle.worker_id]
        assert moved.base_round == 1 and moved.local_step == 1
        head.train_step(*data[h + 1])  # stage 2's second inner step: its round 2
        idle.service.drain()
        assert moved.base_round == 2 and moved.sync_metrics["rounds"] == 1  # (joins not counted)
        assert server.status()["swarm"]["stages"][2]["round"] == 2
        later = latest_checkpoint(tmp_path / "stage-2")
        assert later is not None and later.round == 2
