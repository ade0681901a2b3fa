"""A worker that starts from a checkpoint's state (``DiLoCoWorker(start_state=...)``,
``worker/state/start_state.py``): what a swarm peer moved to a stage does with the stage's
checkpoint, here on a plain ``diloco server --allreduce`` in process, workers in this thread.

Its join presents the checkpoint's (round, hash) exactly as a member that lived through that
round would; the server's Agreement decides the rest: the newest agreed state makes it the
source; an older one, while a live worker holds the newest, is resynced to it; an older one
with no live worker holding the newest goes on from the checkpoint (the rounds after it are
lost: the Agreement's ``lost``)."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

from diloco import DiLoCoServer, DiLoCoWorker, ServerConfig
from diloco.persistence import list_checkpoints, load_checkpoint
from diloco.worker.state.start_state import StartState

H = 2
FAST = {"poll_timeout": 0.5, "join_timeout": 0.0, "heartbeat_timeout": 0.0}


def model_of(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def worker_of(
    srv: DiLoCoServer, model: nn.Module, save_dir: Path | None = None, **kw: object
) -> DiLoCoWorker:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return DiLoCoWorker(
        model, opt, srv.address, sync_every=H, bf16_comm=False, heartbeat_interval=0.0,
        save_dir=None if save_dir is None else str(save_dir), **kw,  # type: ignore[arg-type]
    )  # fmt: skip


def train(worker: DiLoCoWorker, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 4, generator=gen)
        nn.functional.mse_loss(worker.model(x), y).backward()
        worker.optimizer.step()
        worker.optimizer.zero_grad()


def checkpoint_at(folder: Path, r: int) -> StartState:
    [path] = [p for p in list_checkpoints(folder) if load_checkpoint(p).round == r][-1:]
    return StartState.of_checkpoint(load_checkpoint(path))


def params(worker: DiLoCoWorker) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in worker._local.params.items()}


def two_rounds(srv: DiLoCoServer, folder: Path) -> tuple[DiLoCoWorker, list[tuple[int, str]]]:
    """Worker A alone (momentum 0.9, ``--save-every 1``) through rounds 1 and 2; the states it
    held after each. A is still running."""
    a = worker_of(srv, model_of(0), folder).start()
    held = []
    for r in (1, 2):
        train(a, H, seed=r)
        state = a.held_state()
        assert state is not None and state[0] == r
        held.append(state)
    return a, held


@pytest.mark.timeout(60)
def test_the_newest_checkpoint_makes_the_worker_the_source(tmp_path: Path) -> None:
    """A leaves after round 2; B (other initial weights) starts from round 2's checkpoint: its
    join presents A's (2, hash), which the run agreed on, so its quorum forms with B as the
    source (nothing received), B holds the checkpoint's bytes, and its next round is 3."""
    with DiLoCoServer(ServerConfig(port=0, allreduce=True, save_every=1, **FAST)) as srv:
        a, held = two_rounds(srv, tmp_path)
        a.stop()
        start = checkpoint_at(tmp_path, 2)
        assert start.momentum is not None  # momentum 0.9: the hash covers it
        b = worker_of(srv, model_of(1), start_state=start).start()
        try:
            assert b.held_state() == held[1] and b.sync_metrics["rebases"] == 0
            assert all(torch.equal(t, start.params[n]) for n, t in params(b).items())
            train(b, H, seed=3)
            assert b.base_round == 3
        finally:
            b.stop()


@pytest.mark.timeout(60)
def test_an_older_checkpoint_with_no_live_holder_of_the_newest_goes_on_from_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A leaves after round 2; B starts from round 1's checkpoint. No live worker holds round
    2, so the quorum goes on from round 1 (the Agreement's ``lost``, logged): round 2 made
    before is lost, and B's own round 2 is another state."""
    with DiLoCoServer(ServerConfig(port=0, allreduce=True, save_every=1, **FAST)) as srv:
        a, held = two_rounds(srv, tmp_path)
        a.stop()
        with caplog.at_level(logging.WARNING, logger="diloco.server.allreduce.agreement"):
            b = worker_of(srv, model_of(1), start_state=checkpoint_at(tmp_path, 1)).start()
        try:
            assert b.held_state() == held[0]
            assert "no live worker holds the run's state of round 2" in caplog.text
            train(b, H, seed=3)
            state = b.held_state()
            assert state is not None and state[0] == 2 and state != held[1]
        finally:
            b.stop()


@pytest.mark.timeout(60)
def test_an_older_checkpoint_while_a_live_worker_holds_the_newest_is_resynced(
    tmp_path: Path,
) -> None:
    """A lives on past round 2; B starts from round 1's checkpoint. B's join does not start a
    quorum from round 1 while A (live, not asking yet) may hold round 2: it waits for A's next
    sync, and that quorum hands B A's state (a resync), so both then hold the same state."""
    with DiLoCoServer(ServerConfig(port=0, allreduce=True, save_every=1, **FAST)) as srv:
        a, held = two_rounds(srv, tmp_path)
        b = worker_of(srv, model_of(1), start_state=checkpoint_at(tmp_path, 1))
        joined = threading.Thread(target=b.start)
        try:
            joined.start()
            for step in range(10 * H):  # A trains on; B's join rides on one of its syncs
                train(a, 1, seed=10 + step)
                # B received the state before that quorum's average, which A's sync waited for:
                # stop here, as a sync of A now would wait for B, which trains nothing.
                if a.local_step == 0 and b.base_round > 1:
                    break
            joined.join(30)
            assert not joined.is_alive()
            assert b.sync_metrics["rebases"] == 1
            state = b.held_state()
            assert state is not None and state == a.held_state() and state[0] > 2
        finally:
            b.stop()
            a.stop()
