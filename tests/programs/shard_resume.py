"""The ranks of the sharded-group resume tests (FSDP2 over gloo on 127.0.0.1): a group trains,
saves a checkpoint mid-round and dies; new processes resume from it as the same worker.

The training loop's own checkpoint (model and AdamW state) is ``torch.distributed.checkpoint``,
the usual way for FSDP2; the worker's state beside it is ``diloco.worker.resume``: every rank
writes its snapshot shard, rank 0 the counters."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from diloco.worker import resume
from tests.helpers.ranks import BATCH, ROUNDS, SYNC_EVERY, batches, leave, make_inner
from tests.programs.group_ranks import _init
from tests.programs.shard_codec_ranks import residual_boxes
from tests.programs.shard_ranks import _sharded_model, _shards, _worker

SAVE_AT = SYNC_EVERY + 2
"""The checkpoint's step: two local steps after the first sync."""


def _step(model: torch.nn.Module, opt: Any, x: torch.Tensor, y: torch.Tensor) -> None:
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()


def first_rank(
    rank: int,
    port: int,
    server: str,
    out: str,
    mesh: tuple[int, ...],
    blocked: bool = False,
    codec: str | None = None,
) -> None:
    """Train to ``SAVE_AT`` on stream ``rank``, checkpoint, then die without leaving (a crash:
    the server still counts the worker). ``blocked``: first a checkpoint into a folder where
    rank 1 cannot write its shard (a directory in the way), its errors recorded. ``codec``:
    the residual boxes at the checkpoint are recorded too."""
    _init(rank, port)
    model = _sharded_model(mesh)
    opt = make_inner(model.parameters())
    worker = _worker(model, opt, server, codec=codec)
    worker.start()
    for x, y in batches(rank, SAVE_AT):
        _step(model, opt, x, y)
        worker.report(samples=BATCH)
    errors = []
    if blocked:
        stuck = Path(out) / "blocked"
        if rank == 1:
            (stuck / "diloco_snapshot.rank1.safetensors.tmp").mkdir(parents=True)
        try:
            resume.save(worker, str(stuck))
        except OSError as exc:
            errors.append(str(exc))
    folder = Path(out) / "ckpt"
    assert resume.gather(worker)  # every rank of a sharded group saves its part
    resume.save(worker, str(folder))
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(folder / "dcp"))
    facts = {"worker_id": worker.worker_id, "shards": _shards(model), "errors": errors}
    facts["residual"] = residual_boxes(worker)
    torch.save(facts, Path(out) / f"first{rank}.pt")
    leave()


def again_rank(
    rank: int, port: int, server: str, out: str, mesh: tuple[int, ...], codec: str | None = None
) -> None:
    """New processes: load the checkpoint (under ``mesh``, maybe not the one it was saved
    under), resume as its worker, train to ``SYNC_EVERY * ROUNDS`` and leave. Records the
    shards (and residual boxes) at the start, and the resume's error if it fails."""
    _init(rank, port)
    torch.manual_seed(99)  # nothing of this model's own initialisation may survive the resume
    model = _sharded_model(mesh)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    opt = make_inner(model.parameters())
    folder = Path(out) / "ckpt"
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(folder / "dcp"))
    set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    loaded = _shards(model)
    saved = resume.load(str(folder))
    assert saved is not None
    worker = _worker(model, opt, server, worker_id=saved[0].worker_id, codec=codec)
    facts: dict[str, Any] = {"loaded": loaded}
    try:
        resume.start_resumed(worker, *saved, resume.load_codec_state(str(folder)))
    except ValueError as exc:
        facts["error"] = str(exc)
        torch.save(facts, Path(out) / f"again{rank}.pt")
        leave()
    facts["begin"] = _shards(model)
    facts["residual"] = residual_boxes(worker)
    facts["local_step"] = worker.local_step
    facts["worker_id"] = worker.worker_id
    outcomes = []
    for step, (x, y) in enumerate(batches(rank, SYNC_EVERY * ROUNDS), start=1):
        if step <= SAVE_AT:
            continue
        _step(model, opt, x, y)
        worker.report(samples=BATCH)
        if step % SYNC_EVERY == 0:
            outcomes.append(worker.last_sync_outcome)
    worker.stop()
    facts["outcomes"] = outcomes
    facts["end"] = _shards(model)
    torch.save(facts, Path(out) / f"again{rank}.pt")
    leave()
