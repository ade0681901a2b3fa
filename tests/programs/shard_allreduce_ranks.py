"""The ranks of the sharded worker-group tests in all-reduce mode (FSDP2 over gloo on
127.0.0.1, a plain worker beside it): functions run in spawned processes, compared with
``tests.helpers.ranks.reference_groups``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from diloco import DiLoCoWorker
from diloco.worker.allreduce.collective import QuorumCollective
from tests.helpers.ranks import (
    BATCH,
    ROUNDS,
    SYNC_EVERY,
    batches,
    leave,
    make_inner,
    make_model,
)
from tests.programs.group_ranks import _init
from tests.programs.shard_ranks import _sharded_model, _shards, _worker


def group_rank(
    rank: int,
    port: int,
    server: str,
    group: int,
    out: str,
    mesh: tuple[int, ...],
    comm: str,
    worker_id: str | None = None,
    save_dir: str | None = None,
    die: bool = False,
    shift: bool = False,
) -> None:
    """One rank of an FSDP2 group training ``make_model`` on stream ``2 * group + rank`` in an
    all-reduce run; records its shards after every sync, and the group's metrics and what its
    all-reduce state holds (the shapes of its snapshot, momentum and averaging buffers).
    ``die``: rank 1 exits (its sockets closed) at its first tensor all-reduce with the other
    groups' rank 1, while they are inside it; the group beats, so the server leaves it out.
    ``shift``: the model starts 0.01 away from ``make_model``'s (one group resyncs)."""
    _init(rank, port)
    if die and rank == 1:
        _exit_in(QuorumCollective, "all-reduce")
    model = _sharded_model(mesh)
    if shift:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01)
    opt = make_inner(model.parameters())
    records: list[dict[str, Any]] = []
    kw: dict[str, Any] = {"worker_id": worker_id, "save_dir": save_dir}
    if die:
        kw["heartbeat_interval"] = 0.2
    with _worker(model, opt, server, bf16_comm=comm == "bf16", **kw) as worker:
        for step, (x, y) in enumerate(batches(2 * group + rank, SYNC_EVERY * ROUNDS), start=1):
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            worker.report(samples=BATCH)
            if step % SYNC_EVERY == 0:
                records.append(
                    {
                        "round": worker.base_round,
                        "outcome": worker.last_sync_outcome,
                        "shards": _shards(model),
                    }
                )
        shards = worker._group.shards  # type: ignore[union-attr]
        assert shards is not None
        state = worker._group.local.outer if rank == 0 else None  # type: ignore[union-attr]
        facts = {
            "snapshot": {n: tuple(t.shape) for n, t in shards.snapshot.items()},
            "metrics": dict(worker.metrics),
            "worker_id": worker.worker_id,
            "rank0_state": None
            if state is None
            else {
                "acc": {n: tuple(t.shape) for n, t in state.acc.items()},
                "momentum": {n: tuple(t.shape) for n, t in state.momentum.items()},
            },
            "staging": shards.staging.sizes(),
            # How the rounds averaged: shard with shard (every rank's exchange commands) or
            # through rank 0 (the parameters it put together, by kind).
            "served": dict(worker._group.outer.positions.served),  # type: ignore[union-attr]
            "gathered": None if state is None else dict(state.gathered),
        }
    torch.save({"records": records, "facts": facts}, Path(out) / f"g{group}r{rank}.pt")
    leave()


def plain_rank(
    rank: int,
    port: int,
    server: str,
    group: int,
    out: str,
    die: bool,
    shift: bool = False,
    worker_id: str | None = None,
) -> None:
    """A single-process worker on the mean loss of streams ``2 * group`` and ``2 * group + 1``
    (what a group of two ranks computes), recording its parameters after every sync. ``die``:
    it exits (its sockets closed, as a killed process's) at its first averaging all-reduce,
    while the other members are inside that collective. ``shift``: its model starts 0.01
    away from ``make_model``'s (another state: one member resyncs at the join)."""
    torch.set_num_threads(1)
    if die:
        _exit_in(QuorumCollective, "all-reduce")
    model = make_model()
    if shift:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01)
    opt = make_inner(model.parameters())
    data = zip(*(batches(2 * group + r, SYNC_EVERY * ROUNDS) for r in range(2)), strict=True)
    records: list[dict[str, Any]] = []
    # The dying worker beats: the server leaves it out once it is silent for two beats.
    beats = 0.2 if die else 0
    with DiLoCoWorker(
        model,
        opt,
        server,
        sync_every=SYNC_EVERY,
        bf16_comm=False,
        heartbeat_interval=beats,
        worker_id=worker_id,
    ) as worker:
        for step, halves in enumerate(data, start=1):
            loss = sum(torch.nn.functional.mse_loss(model(x), y) for x, y in halves) / 2
            assert isinstance(loss, torch.Tensor)
            loss.backward()
            opt.step()
            opt.zero_grad()
            worker.report(samples=2 * BATCH)
            if step % SYNC_EVERY == 0:
                records.append(
                    {
                        "round": worker.base_round,
                        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
                    }
                )
    torch.save(records, Path(out) / f"plain{group}.pt")


def _exit_in(cls: Any, collective: str) -> None:
    """This process exits with code 3 as it enters its first ``collective`` of the quorum
    collectives (its sockets closed, as a killed process's)."""
    original = cls.collective

    def hooked(self: QuorumCollective, what: str, start: Any) -> None:
        if what == collective:
            os._exit(3)
        original(self, what, start)

    cls.collective = hooked
