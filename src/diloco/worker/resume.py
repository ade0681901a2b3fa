"""A worker's place in a run, kept in a training loop's checkpoint so a restarted loop rejoins as
the same worker (the trainer integrations use it; a plain loop may too).

A checkpoint's model holds ``snapshot + progress``: the global parameters of the round it last
adopted plus the local steps taken since. Restarting, the worker registers under its old id and
fetches the parameters the server serves now; the progress is put back on top of them (a rebase,
as after a lost connection), so no local step is lost or counted twice when the run did not move
on, and none is lost when it did. Two files go into the checkpoint folder: the counters as JSON
and the snapshot as safetensors (fp32, one copy of the model); a worker with a lossy codec adds a
third, its error-feedback residual and the codec's own state (low rank's warm-start ``Q``), also
safetensors, so what its codec dropped from earlier uploads is still sent after a restart (in
all-reduce mode the same file holds the quorum residuals, ``allreduce/quantized.py``). In a
worker group the state is rank 0's: every rank calls ``gather`` before a checkpoint and
``start_resumed`` to resume.

A sharded group (FSDP2, DTensor) has no whole snapshot on any rank: every rank writes its own
boxes (``diloco_snapshot.rank{R}.safetensors``, ``worker/state/snapshot_shards.py``) and rank 0
the counters; resuming, every rank reads the boxes it holds now, re-sliced from the saved ranks'
files when the checkpoint was saved under another sharding.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from diloco.core import to_progress_
from diloco.core.shards import Box
from diloco.worker.state import snapshot_shards
from diloco.worker.state.encoder import RESIDUAL
from diloco.worker.state.snapshot_shards import ShardedSnapshot

if TYPE_CHECKING:
    from diloco.worker.worker import DiLoCoWorker

log = logging.getLogger(__name__)

STATE_FILE = "diloco_worker.json"
SNAPSHOT_FILE = "diloco_snapshot.safetensors"
CODEC_FILE = "diloco_codec_state.safetensors"


@dataclass(frozen=True)
class WorkerState:
    """What a checkpoint says about the worker that wrote it."""

    worker_id: str
    """The id the server knows the worker by; a resumed worker registers under it."""
    round: int
    """The round of the global parameters the local progress is measured from."""
    local_step: int
    """Inner steps since the last sync: the next sync comes ``sync_every - local_step`` later."""
    total_steps: int
    """Inner steps since the worker first joined."""
    samples: float
    """Samples reported since the last upload (its weight)."""
    tokens: float = 0.0
    """Tokens reported since the last upload (its weight under ``--weighting tokens``; absent
    from the checkpoints of workers from before tokens were counted)."""


def capture(worker: DiLoCoWorker) -> WorkerState:
    s = worker._session
    if s.worker_id is None:
        raise RuntimeError("the worker has not joined a run yet")
    return WorkerState(s.worker_id, s.base_round, s.local_step, s.total_steps, s.samples, s.tokens)


def snapshot(worker: DiLoCoWorker) -> dict[str, torch.Tensor]:
    """A copy of the global parameters the worker's local progress is measured from (in a
    sharded group, this rank's boxes of them)."""
    assert not worker._local.holds_progress, "taken in the middle of a sync"
    shards = _shards(worker)
    held = worker._local.snapshot if shards is None else shards.snapshot
    return {n: t.detach().to("cpu", copy=True) for n, t in held.items()}


def _shards(worker: DiLoCoWorker) -> Any:
    """The ``ShardState`` of a sharded group's rank (``worker/groups/sharded.py``), else None."""
    group = worker._group
    return None if group is None else group.shards


def codec_state(worker: DiLoCoWorker) -> dict[str, torch.Tensor]:
    """CPU copies of the error-feedback residual and the codec's state (empty for fp32 and
    bf16): ``UploadEncoder.state_dict``; in all-reduce mode also the quorum residuals
    (``Session.saved_feedback``, keys of their own)."""
    return {**worker._encoder.state_dict(), **worker._session.saved_feedback()}


def save(worker: DiLoCoWorker, folder: str) -> WorkerState:
    """Write the worker's state and snapshot into a checkpoint ``folder`` (between steps only; in
    a worker group on rank 0, once every rank called ``gather``). In a sharded group every rank
    calls it (a collective): each writes its boxes, creating ``folder`` if needed, and rank 0
    the counters once every rank's file is in (a failed write raises on every rank, with no
    counters written)."""
    state = capture(worker)
    shards = _shards(worker)
    if shards is not None:
        save_shard(worker, folder)
        if shards.rank != 0:
            return state
    else:
        save_file(snapshot(worker), os.path.join(folder, SNAPSHOT_FILE))
    extra = codec_state(worker)
    if extra:
        save_file(extra, os.path.join(folder, CODEC_FILE), metadata=worker._encoder.metadata)
    tmp = os.path.join(folder, STATE_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(asdict(state), f, indent=1)
    os.replace(tmp, os.path.join(folder, STATE_FILE))
    return state


def sharded(worker: DiLoCoWorker) -> bool:
    """Whether ``worker`` is a rank of a sharded group (each rank saves its own snapshot)."""
    return _shards(worker) is not None


def save_shard(worker: DiLoCoWorker, folder: str) -> None:
    """A sharded group's ranks, all of them (a collective): each writes its snapshot boxes, and
    the residual boxes it owns (a lossy codec's, once committed), into ``folder`` (created if
    needed); a failed write raises the same ``OSError`` on every rank."""
    shards = _shards(worker)
    assert shards is not None
    group = worker._group
    assert group is not None and group.residuals is not None
    residuals = group.residuals
    residual = residuals.saved()  # this rank's owned boxes, beside its snapshot boxes
    layout = snapshot_shards.sharding(shards.plans, shards.size)
    layout["residual"] = any(residuals.kept())  # the owners' files hold theirs (a collective)
    error = None
    try:
        os.makedirs(folder, exist_ok=True)
        snapshot_shards.write_shard(folder, shards.rank, snapshot(worker), layout, residual)
    except OSError as exc:
        error = f"rank {shards.rank} of the sharded worker group could not save its snapshot: {exc}"
    error = shards.first_error(error)
    if error is not None:
        raise OSError(error)


Snapshot = Mapping[str, torch.Tensor]
"""A checkpoint's snapshot: whole tensors (``load_file``), or a sharded group's
``ShardedSnapshot``, read by box."""


def load(folder: str) -> tuple[WorkerState, Snapshot] | None:
    """The state a checkpoint ``folder`` holds; None when it holds none. A sharded group's
    snapshot comes as a ``ShardedSnapshot``, nothing read until a box is asked for."""
    path = os.path.join(folder, STATE_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        raw = json.load(f)
    try:
        state = WorkerState(**raw)
    except TypeError as exc:
        raise ValueError(f"{path} is not a DiLoCo worker state: {exc}") from None
    sharded = snapshot_shards.find(folder)
    if sharded is not None:
        return state, sharded
    return state, load_file(os.path.join(folder, SNAPSHOT_FILE))


def load_shard(folder: str) -> ShardedSnapshot | None:
    """A sharded group's snapshot files in ``folder``, for a rank whose machine has its own
    shard but not rank 0's counters (``start_resumed`` takes rank 0's); None if none."""
    return snapshot_shards.find(folder)


def load_codec_state(folder: str) -> dict[str, torch.Tensor] | None:
    """The residual and codec state a checkpoint ``folder`` holds (``codec_state``); None when
    it holds none (a worker without error feedback, or a checkpoint from before the codecs)."""
    path = os.path.join(folder, CODEC_FILE)
    return load_file(path) if os.path.isfile(path) else None


def gather(worker: DiLoCoWorker) -> bool:
    """Before a checkpoint, on every rank of a worker group (a collective): the samples each rank
    reported since the last sync are summed onto rank 0, whose state the checkpoint holds. True
    where that state is: rank 0 of a group, or a worker without one."""
    group = worker._group
    if group is None:
        return True
    s = worker._session
    s.samples, s.tokens = group.pool_counts(s.samples, s.tokens)
    return group.leader or group.shards is not None  # a sharded group's ranks each save a part


def start_resumed(
    worker: DiLoCoWorker,
    state: WorkerState | None,
    snapshot: Snapshot | None,
    codec: Mapping[str, torch.Tensor] | None = None,
) -> None:
    """Start ``worker`` (built with ``worker_id=state.worker_id``) from a checkpoint's model: join,
    then put the checkpoint's local progress back on top of the parameters just fetched and take
    its counters back, so the schedule of syncs goes on where it was. ``state`` None: ``start``.
    ``codec``: the checkpoint's ``codec_state`` (``load_codec_state``), restored before joining.

    In a worker group every rank calls it (a collective, as ``start`` is) and rank 0's checkpoint
    decides for all: whether to resume, the progress (its parameters, the other ranks' gathered
    to it when partitioned, against its snapshot) and the counters; the other ranks' ``state``
    and ``snapshot`` are not read (None where only rank 0's machine has the worker files). So
    every rank ends with rank 0's parameters and counts to the same next sync.

    A sharded group is the exception: each rank's ``snapshot`` is read, for the boxes it holds
    (``load`` or ``load_shard`` of its checkpoint folder), and each rank keeps its own progress;
    a rank without one fails every rank with the same ``ValueError``."""
    group = worker._group
    leads = group is None or group.leader
    if group is not None:
        shared = group.broadcast_json(asdict(state) if leads and state is not None else None)
        state = WorkerState(**shared) if shared is not None else None
    if state is None:
        worker.start()
        return
    if _shards(worker) is not None:
        _start_sharded(worker, state, snapshot, codec)
        return
    params = worker._local.params
    if group is not None:
        group.collect()  # partitioned: rank 0's mirrors now hold every rank's parameters
    progress: dict[str, torch.Tensor] = {}
    error: ValueError | None = None
    if leads:
        assert snapshot is not None
        try:
            progress = _progress(params, snapshot)
            if codec:
                worker._encoder.load_state_dict(codec)
                worker._session.resumed_feedback = codec  # the strategy's (all-reduce mode)
        except ValueError as exc:
            error = exc
    if group is not None and not group.agree_on(error is None):
        raise error or ValueError("rank 0 of the worker group cannot resume from its checkpoint")
    if error is not None:
        raise error
    worker.start()
    with torch.no_grad():
        for name, delta in progress.items():
            params[name].add_(delta.to(params[name].dtype))
    if group is not None:
        group.share()
    _take_counters(worker, state, leads)


def _take_counters(worker: DiLoCoWorker, state: WorkerState, leads: bool) -> None:
    s = worker._session
    s.local_step = min(state.local_step, s.sync_every - 1)
    s.total_steps = state.total_steps
    s.samples = state.samples if leads else 0.0  # a group's samples are kept on rank 0
    s.tokens = state.tokens if leads else 0.0
    log.info(
        "worker %s resumed: %d local steps since round %d kept on top of round %d",
        s.worker_id,
        state.local_step,
        state.round,
        s.base_round,
    )


def _start_sharded(
    worker: DiLoCoWorker,
    state: WorkerState,
    snapshot: Snapshot | None,
    codec: Mapping[str, torch.Tensor] | None,
) -> None:
    """``start_resumed`` on a rank of a sharded group: its own progress, box by box; its owned
    residual boxes (re-sliced as the snapshot's), and rank 0's codec state."""
    shards = _shards(worker)
    group = worker._group
    assert group is not None and group.residuals is not None
    progress: dict[str, torch.Tensor] = {}
    residual: dict[str, torch.Tensor] | None = None
    error = None
    try:
        progress = _shard_progress(shards, snapshot)
        residual = _shard_residual(shards, snapshot)
        if group.leader and codec:
            _load_codec_state(worker, codec)
            worker._session.resumed_feedback = codec
    except (ValueError, OSError, SafetensorError) as exc:  # a file of one rank: every rank fails
        error = f"rank {shards.rank} of the sharded worker group cannot resume: {exc}"
    error = shards.first_error(error)
    if error is not None:
        raise ValueError(error)
    group.residuals.restore(residual, worker._encoder)
    worker.start()
    with torch.no_grad():
        for name, delta in progress.items():
            local = shards.local(name)
            local.add_(delta.to(local.device, local.dtype))
    group.share()  # plain parameters: rank 0's, progress included
    _take_counters(worker, state, group.leader)


def _shard_progress(shards: Any, snapshot: Snapshot | None) -> dict[str, torch.Tensor]:
    """``local - snapshot`` (fp32) of every box this rank holds, each read from ``snapshot``
    (whole tensors are cut to the box; a ``ShardedSnapshot`` reads the box alone)."""
    if snapshot is None:
        raise ValueError("its checkpoint folder holds no DiLoCo snapshot shard")
    if set(snapshot) != set(shards.plans):
        raise ValueError(
            "the checkpoint's DiLoCo snapshot does not fit the model: "
            f"{sorted(set(snapshot) ^ set(shards.plans))[:3]}"
        )
    progress = {}
    with torch.no_grad():
        for name in shards.snapshot:
            plan = shards.plans[name]
            box: Box = plan.boxes[shards.rank][0]
            shape = (
                snapshot.shape(name)
                if isinstance(snapshot, ShardedSnapshot)
                else tuple(snapshot[name].shape)
            )
            if shape != tuple(plan.shape):
                raise ValueError(
                    f"parameter {name!r} is {shape} in the checkpoint, {plan.shape} here"
                )
            if isinstance(snapshot, ShardedSnapshot):
                saved = snapshot.box(name, box, shards.rank)
            else:
                saved = box.read(snapshot[name]).to(torch.float32)
            local = shards.local(name).detach().to("cpu", torch.float32, copy=True)
            to_progress_(local, saved)
            progress[name] = local
    return progress


def _shard_residual(shards: Any, snapshot: Snapshot | None) -> dict[str, torch.Tensor] | None:
    """The residual of every box this rank owns, from the owners' files of a sharded checkpoint
    (re-sliced as the snapshot); None when the checkpoint holds none."""
    if not isinstance(snapshot, ShardedSnapshot) or not snapshot.has_residual:
        return None
    out = {}
    for name, plan in shards.plans.items():
        held = plan.boxes[shards.rank]
        if held is not None and held[1]:
            out[name] = snapshot.box(name, held[0], shards.rank, key=RESIDUAL + name)
    return out


def _load_codec_state(worker: DiLoCoWorker, codec: Mapping[str, torch.Tensor]) -> None:
    """Rank 0 of a sharded group: the codec's own state (low rank's ``Q``). A whole residual (a
    single worker's checkpoint) is not cut into shards: dropped with a warning."""
    whole = [k for k in codec if k.startswith(RESIDUAL)]
    if whole:
        log.warning(
            "the checkpoint's residual is a single worker's (%d tensors, whole): a sharded group "
            "keeps its residual on the shards and starts this one from zero",
            len(whole),
        )
    worker._encoder.load_state_dict({k: t for k, t in codec.items() if k not in whole})


def _progress(
    params: Mapping[str, torch.Tensor], snapshot: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``params - snapshot`` in fp32, parameter by parameter."""
    if set(snapshot) != set(params):
        raise ValueError(
            "the checkpoint's DiLoCo snapshot does not fit the model: "
            f"{sorted(set(snapshot) ^ set(params))[:3]}"
        )
    progress = {}
    with torch.no_grad():
        for name, p in params.items():
            local = p.detach().to(torch.float32, copy=True)
            to_progress_(local, snapshot[name].to(local.device))
            progress[name] = local
    return progress
