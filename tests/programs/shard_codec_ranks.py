"""The ranks of the sharded-group codec tests (FSDP2 over gloo on 127.0.0.1): a lossy codec whose
error-feedback residual lives on the owners' shards. Compared with
``tests.helpers.ranks.reference_groups(..., codec=...)``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from diloco import DiLoCoClient, DiLoCoWorker
from diloco.worker.transport.client import Unreachable
from tests.helpers.ranks import BATCH, ROUNDS, SYNC_EVERY, batches, leave, make_inner
from tests.programs.group_ranks import _init
from tests.programs.shard_ranks import _sharded_model, _worker


class BodyThenUnreachable(DiLoCoClient):
    """Rank 0's client: the 2nd upload's body is encoded in full (every parameter gathered from
    the shards), then the server is unreachable, so the server never counts it."""

    def __init__(self, server: str) -> None:
        super().__init__(server, retries=1, backoff=0.01)
        self.uploads = 0

    def submit_pseudogradients(self, worker_id: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
        self.uploads += 1
        if self.uploads == 2:
            _, _, specs, produce = args[:4]
            for spec in specs:
                got = produce(spec)
                if not isinstance(got, torch.Tensor):
                    list(got)
            raise Unreachable("scripted: the body was encoded, then the server is unreachable")
        return super().submit_pseudogradients(worker_id, *args, **kwargs)


def residual_boxes(worker: DiLoCoWorker) -> dict[str, tuple[torch.Tensor, tuple[int, ...]]]:
    """This rank's residual boxes (copies) and where each starts in its parameter."""
    shards = worker._group.shards  # type: ignore[union-attr]
    assert shards is not None
    out = {}
    for name, e in shards.residual.items():
        held = shards.plans[name].boxes[shards.rank]
        assert held is not None
        out[name] = (e.clone(), tuple(held[0].offset))
    return out


def owned_shapes(worker: DiLoCoWorker) -> dict[str, tuple[int, ...]]:
    """The shape of each box this rank owns."""
    shards = worker._group.shards  # type: ignore[union-attr]
    assert shards is not None
    held = {n: p.boxes[shards.rank] for n, p in shards.plans.items()}
    return {n: tuple(h[0].shape) for n, h in held.items() if h is not None and h[1]}


def codec_rank(
    rank: int,
    port: int,
    server: str,
    group: int,
    out: str,
    mesh: tuple[int, ...],
    codec: str,
    faults: bool = False,
) -> None:
    """One rank of an FSDP2 group with ``codec``, training ``make_model`` on stream
    ``2 * group + rank``; records its residual boxes and ``residual_norm`` after every sync, and
    rank 0's staging. ``faults``: rank 0's 2nd upload is encoded, then never counted."""
    _init(rank, port)
    model = _sharded_model(mesh)
    opt = make_inner(model.parameters())
    client = BodyThenUnreachable(server) if faults and rank == 0 else None
    records: list[dict[str, Any]] = []
    with _worker(model, opt, server, codec=codec, client=client) as worker:
        for step, (x, y) in enumerate(batches(2 * group + rank, SYNC_EVERY * ROUNDS), start=1):
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            worker.report(samples=BATCH)
            if step % SYNC_EVERY == 0:
                records.append(
                    {
                        "outcome": worker.last_sync_outcome,
                        "residual": residual_boxes(worker),
                        "norm": worker.sync_metrics["residual_norm"],
                    }
                )
        shards = worker._group.shards  # type: ignore[union-attr]
        facts = {"staging": shards.staging.sizes(), "owned": owned_shapes(worker)}
    torch.save({"records": records, "facts": facts}, Path(out) / f"c{group}r{rank}.pt")
    leave()
