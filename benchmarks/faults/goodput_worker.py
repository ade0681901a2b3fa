"""The goodput benchmark's worker program: one life of a worker slot on the demo model.

A life starts from the slot's newest checkpoint when it has one (a restart after ``kill -9``)
and trains until the worker's ``total_steps`` reaches the slot's budget, so a kill costs the
steps since the last checkpoint, which are computed again. The checkpoint is written after every
sync (``diloco.worker.resume``: the worker's counters and snapshot, plus the model's parameters,
so local progress a failed sync left in the model is kept too), each into a folder of its own
renamed into place when complete: a kill during a save leaves the one before.

A kill or a freeze lands at an exact step: the parent sets the slot's ``park`` step, the worker
waits there (between two steps, its heartbeat going on) until the parent kills or stops it.

What the parent reads, in shared arrays indexed by slot (``Counters``): inner steps computed, in
all lives; the computed count at the slot's newest checkpoint (what a kill loses is the
difference); seconds spent computing steps (forward, backward, the inner optimizer, without the
straggler's delay and without syncs); the steps the worker dropped (``dropped_steps``). The
straggler's delay is a shared factor the parent sets and clears (``slow``): after each step the
worker sleeps ``factor - 1`` times that step's compute, so it runs at ``1/factor`` of its own
speed whatever the machine's load.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class Counters:
    """Shared arrays, one entry per worker slot (``multiprocessing`` ``Array``s)."""

    computed: Any  # 'i': inner steps computed, all lives
    at_checkpoint: Any  # 'i': ``computed`` when the newest checkpoint was written
    timed: Any  # 'i': steps timed (those with no sync in them)
    compute_s: Any  # 'd': seconds computing the timed steps
    dropped: Any  # 'i': dropped_steps reported, all lives
    park: Any  # 'i': when > 0, the worker waits once ``computed`` reaches it (for a fault)
    slow: Any  # 'd': the straggler factor (1: full speed)

    @classmethod
    def make(cls, ctx: Any, n: int) -> Counters:
        def ints() -> Any:
            return ctx.Array("i", n)

        return cls(
            computed=ints(),
            at_checkpoint=ints(),
            timed=ints(),
            compute_s=ctx.Array("d", n),
            dropped=ints(),
            park=ints(),
            slow=ctx.Array("d", [1.0] * n),
        )


MODEL_FILE = "model.safetensors"


def newest_checkpoint(folder: Path) -> Path | None:
    """The slot's newest complete checkpoint folder (named by its total steps), or None."""
    done = sorted(p for p in folder.glob("[0-9]*") if p.is_dir())
    return done[-1] if done else None


def train(slot: int, cfg: dict[str, Any], address: str, counters: Counters) -> None:
    """One life of worker slot ``slot`` (a spawned process)."""
    import logging

    import torch
    from safetensors.torch import load_file, save_file

    from diloco.demo.data import build_corpus, sample_batch
    from diloco.demo.model import build_model, loss_on
    from diloco.worker import DiLoCoClient, DiLoCoWorker, resume

    logging.basicConfig(level=logging.ERROR)
    torch.set_num_threads(1)
    tokens = build_corpus(cfg["workers"]).shards[slot]
    model = build_model(cfg["seed"])
    folder = Path(cfg["workdir"]) / f"worker{slot}"
    folder.mkdir(parents=True, exist_ok=True)
    saved = newest_checkpoint(folder)
    state = snapshot = None
    if saved is not None:
        loaded = resume.load(str(saved))
        assert loaded is not None, saved
        state, snapshot = loaded
        model.load_state_dict(load_file(str(saved / MODEL_FILE)), strict=False)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"])  # inner state: not kept
    # A new life draws new batches: its seed counts the steps the slot computed before it.
    gen = torch.Generator().manual_seed(cfg["seed"] * 1000 + slot * 7919 + counters.computed[slot])
    client = DiLoCoClient(address, retries=8, backoff=0.2, max_backoff=2.0, read_timeout=30)
    worker = DiLoCoWorker(
        model,
        opt,
        address,
        sync_every=cfg["sync_every"],
        worker_id=f"w{slot}",
        heartbeat_interval=cfg["heartbeat_interval"],
        client=client,
    )
    resume.start_resumed(worker, state, snapshot)
    dropped0 = counters.dropped[slot]
    compute = 0.0  # the last step's with no sync in it
    try:
        while worker.total_steps < cfg["steps"]:
            t = time.perf_counter()
            x, y = sample_batch(tokens, cfg["batch_size"], cfg["seq_len"], gen)
            loss = loss_on(model, x, y)
            loss.backward()
            opt.step()  # the sync, every sync_every steps, runs inside
            synced = worker.local_step == 0
            if not synced:  # a step with a sync in it is not timed
                compute = time.perf_counter() - t
                counters.compute_s[slot] += compute
                counters.timed[slot] += 1
            opt.zero_grad()
            worker.report(loss=float(loss.detach()), samples=x.numel())
            counters.computed[slot] += 1
            if synced:
                counters.dropped[slot] = dropped0 + int(worker.sync_metrics.get("dropped_steps", 0))
                _save(worker, model, folder, counters, slot, save_file)
            factor = counters.slow[slot]
            if factor > 1.0:
                time.sleep((factor - 1.0) * compute)
            while 0 < counters.park[slot] <= counters.computed[slot]:
                time.sleep(0.01)  # a fault's exact step: the parent kills or stops it here
    finally:
        worker.stop()
    counters.dropped[slot] = dropped0 + int(worker.sync_metrics.get("dropped_steps", 0))


def _save(
    worker: Any, model: Any, folder: Path, counters: Counters, slot: int, save_file: Any
) -> None:
    """A checkpoint into a folder of its own, renamed into place when complete; older ones go."""
    from diloco.worker import resume

    name = f"{worker.total_steps:09d}"
    tmp = folder / f"tmp-{name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file(
        {n: p.detach().contiguous() for n, p in model.named_parameters()}, str(tmp / MODEL_FILE)
    )
    resume.save(worker, str(tmp))
    final = folder / name
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    counters.at_checkpoint[slot] = counters.computed[slot]
    for old in folder.glob("[0-9]*"):
        if old != final:
            shutil.rmtree(old, ignore_errors=True)
