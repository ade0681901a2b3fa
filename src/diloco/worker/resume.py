"""A worker's place in a run, kept in a training loop's checkpoint so a restarted loop rejoins as
the same worker (the trainer integrations use it; a plain loop may too).

A checkpoint's model holds ``snapshot + progress``: the global parameters of the round it last
adopted plus the local steps taken since. Restarting, the worker registers under its old id and
fetches the parameters the server serves now; the progress is put back on top of them (a rebase,
as after a lost connection), so no local step is lost or counted twice when the run did not move
on, and none is lost when it did. Two files go into the checkpoint folder: the counters as JSON
and the snapshot as safetensors (fp32, one copy of the model); a worker with a lossy codec adds a
third, its error-feedback residual and the codec's own state (low rank's warm-start ``Q``), also
safetensors, so what its codec dropped from earlier uploads is still sent after a restart. In a
worker group the state is rank 0's: every rank calls ``gather`` before a checkpoint and
``start_resumed`` to resume.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file, save_file

from diloco.core import to_progress_

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


def capture(worker: DiLoCoWorker) -> WorkerState:
    s = worker._session
    if s.worker_id is None:
        raise RuntimeError("the worker has not joined a run yet")
    return WorkerState(s.worker_id, s.base_round, s.local_step, s.total_steps, s.samples)


def snapshot(worker: DiLoCoWorker) -> dict[str, torch.Tensor]:
    """A copy of the global parameters the worker's local progress is measured from."""
    assert not worker._local.holds_progress, "taken in the middle of a sync"
    return {n: t.detach().to("cpu", copy=True) for n, t in worker._local.snapshot.items()}


def codec_state(worker: DiLoCoWorker) -> dict[str, torch.Tensor]:
    """CPU copies of the error-feedback residual and the codec's state (empty for fp32 and
    bf16): ``UploadEncoder.state_dict``."""
    return worker._encoder.state_dict()


def save(worker: DiLoCoWorker, folder: str) -> WorkerState:
    """Write the worker's state and snapshot into a checkpoint ``folder`` (between steps only; in
    a worker group on rank 0, once every rank called ``gather``)."""
    state = capture(worker)
    save_file(snapshot(worker), os.path.join(folder, SNAPSHOT_FILE))
    extra = codec_state(worker)
    if extra:
        save_file(extra, os.path.join(folder, CODEC_FILE), metadata=worker._encoder.metadata)
    tmp = os.path.join(folder, STATE_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(asdict(state), f, indent=1)
    os.replace(tmp, os.path.join(folder, STATE_FILE))
    return state


def load(folder: str) -> tuple[WorkerState, dict[str, torch.Tensor]] | None:
    """The state a checkpoint ``folder`` holds; None when it holds none."""
    path = os.path.join(folder, STATE_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        raw = json.load(f)
    try:
        state = WorkerState(**raw)
    except TypeError as exc:
        raise ValueError(f"{path} is not a DiLoCo worker state: {exc}") from None
    return state, load_file(os.path.join(folder, SNAPSHOT_FILE))


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
    s.samples = group.pool_samples(s.samples)
    return group.leader


def start_resumed(
    worker: DiLoCoWorker,
    state: WorkerState | None,
    snapshot: Mapping[str, torch.Tensor] | None,
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
    every rank ends with rank 0's parameters and counts to the same next sync."""
    group = worker._group
    leads = group is None or group.leader
    if group is not None:
        shared = group.broadcast_json(asdict(state) if leads and state is not None else None)
        state = WorkerState(**shared) if shared is not None else None
    if state is None:
        worker.start()
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
    s = worker._session
    s.local_step = min(state.local_step, s.sync_every - 1)
    s.total_steps = state.total_steps
    s.samples = state.samples if leads else 0.0  # a group's samples are kept on rank 0
    log.info(
        "worker %s resumed: %d local steps since round %d kept on top of round %d",
        s.worker_id,
        state.local_step,
        state.round,
        s.base_round,
    )


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
