"""Training trials: an in-process server and worker threads training the demo model (or a
model the caller supplies), each with its own shard, optional per-step delays, a step budget,
an optional learning-rate schedule and an optional eval curve. With ``clock`` the delays are
simulated step costs and ``sim_clock.SimClock`` orders the uploads (deterministic given the
seed); without it they are real sleeps.

Threads, not processes: the simulated step delays (sleeps) dominate each step, torch releases
the GIL in its kernels, and one process keeps the budget counter and the results simple. Unlike
the process-level modules of this package, it imports torch and diloco at the top.

Used by ``training/async_experiment``, ``training/streaming_experiment``, ``codecs/quality``
and the quality suite (``benchmarks/quality/``).
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from benchmarks.harness.curves import CurveWatcher, thin
from benchmarks.harness.inner import make_inner
from benchmarks.harness.sim_clock import (
    ClockedRun,
    ClockedWorker,
    ClockSettings,
    SimClock,
    params_digest,
    report_speed,
)
from diloco import DiLoCoServer, DiLoCoWorker, ServerConfig
from diloco.demo.data import Corpus, build_corpus, sample_batch
from diloco.demo.model import build_model, evaluate, loss_on

# The server's smallest accepted upload weight (``wire/messages/uploads.py``, MIN_WEIGHT) with a
# margin: a lost upload is sent as zeros with this weight, next to weights of ~1e4 tokens.
LOST_WEIGHT = 2e-6


@dataclass
class Trial:
    name: str
    seed: int
    workers: int = 4
    sync_every: int = 25
    server: dict[str, Any] = field(default_factory=dict)  # extra ServerConfig fields
    worker: dict[str, Any] = field(default_factory=dict)  # extra DiLoCoWorker arguments
    delays: list[float] | None = None  # seconds slept after each step, per worker
    clock: dict[str, float] | None = None  # ClockSettings: delays are simulated step costs
    total_steps: int = 1000  # local steps of all workers together
    shared_budget: bool = False  # True: fast workers take more of the steps (async)
    batch_size: int = 16
    seq_len: int = 64
    lr: float = 3e-3
    # --- the quality suite's protocol (defaults keep the older experiments as they were) ---
    init: dict[str, torch.Tensor] | None = None  # starting parameters (a pretrained checkpoint)
    warmup: int = 0  # inner steps of linear warmup, per worker
    cosine: bool = False  # cosine decay of the inner lr over the run, to min_lr_ratio
    min_lr_ratio: float = 0.1
    corpus: Corpus | None = None  # data (default: the demo's non-iid topic split)
    model_fn: Callable[[int], torch.nn.Module] | None = None  # seed -> model (default: demo's)
    device: str = "cpu"
    curve: bool = False  # record the global model after every outer update, evaluate them after
    curve_windows: int = 128  # eval windows per curve point
    # At most this many curve points evaluated (0: all), spread evenly over the recorded ones,
    # the last always kept: each costs an evaluation, and at small H they would outweigh training.
    curve_points: int = 0
    eval_windows: int = 256  # eval windows of the final model
    drop_prob: float = 0.0  # chance that a worker's upload of a round is lost (claim k)
    inner: str = "adamw"  # the workers' inner optimizer: "adamw" or "muon" (harness/inner.py)
    # time.monotonic() past which a worker stops at its next sync boundary (0: never): a time
    # bound for a run sized for a device session (the row says ``stopped_early``)
    deadline: float = 0.0


class Budget:
    """Local steps left to the run; ``take`` is called before each step."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.left = total
        self._lock = threading.Lock()

    def take(self) -> bool:
        with self._lock:
            if self.left <= 0:
                return False
            self.left -= 1
            return True

    @property
    def done(self) -> float:
        """Fraction of the budget taken."""
        return (self.total - self.left) / max(self.total, 1)


def lr_factor(trial: Trial, own_steps: int, progress: float) -> float:
    """Multiplier of ``trial.lr``: linear warmup over the worker's own first ``warmup`` steps,
    then (with ``cosine``) a cosine from 1 to ``min_lr_ratio`` over the run's progress in [0, 1]."""
    warm = min(1.0, (own_steps + 1) / trial.warmup) if trial.warmup else 1.0
    if not trial.cosine:
        return warm
    cos = 0.5 * (1 + math.cos(math.pi * min(max(progress, 0.0), 1.0)))
    return warm * (trial.min_lr_ratio + (1 - trial.min_lr_ratio) * cos)


class LossyWorker(DiLoCoWorker):
    """A worker whose upload of a round may be lost (claim k), as the DiLoCo paper drops an
    outer gradient (arXiv 2311.08105, "Asynchronous Communication"): left out of the round's
    average, and its worker trains the next H steps on from its own parameters rather than the
    round's result. The server has no notion of a missing upload in sync mode (a round waits for
    every expected worker), so a lost upload is delivered as what the server would have had
    without it: the model is set to the round's snapshot just before the upload (a zero
    pseudo-gradient) and the round's weight is ``LOST_WEIGHT`` (the server averages by reported
    samples). The worker adopts the round's result like everyone else (its snapshot becomes the
    new global parameters), then ``worker_loop`` puts its own parameters back (``kept``), so its
    next upload carries this round's progress and the next one's."""

    lose_next = False
    round_start: list[torch.Tensor] | None = None  # the round's snapshot (adopted parameters)
    kept: list[torch.Tensor] | None = None  # own parameters of a round whose upload was lost

    def _submit(self, submission_id: str) -> dict[str, Any]:
        if self.lose_next and self.round_start is not None:
            with torch.no_grad():
                self.kept = [p.detach().clone() for p in self.model.parameters()]
                for p, p0 in zip(self.model.parameters(), self.round_start, strict=True):
                    p.copy_(p0)
        return super()._submit(submission_id)

    def resume_own(self) -> None:
        """After a lost round's result was adopted: train on from the parameters it ended with."""
        if self.kept is not None:
            with torch.no_grad():
                for p, own in zip(self.model.parameters(), self.kept, strict=True):
                    p.copy_(own)
            self.kept = None


def worker_loop(trial: Trial, rank: int, ctx: dict[str, Any]) -> None:
    """One worker thread: train from the server's parameters until the budget is spent.
    Optional ``ctx`` keys (all-reduce mode, ``allreduce_trials``): ``own_init`` (load
    ``trial.init`` before joining), ``after_step(rank, worker, model)`` and ``final`` (a list
    that gets each rank's parameters after it leaves)."""
    run: ClockedRun | None = ctx.get("clock")
    clock = run.clock if run is not None else None
    model = ctx["model_fn"](trial.seed).to(trial.device)
    if ctx.get("own_init") and trial.init is not None:
        model.load_state_dict(trial.init)  # all-reduce mode: no server holds the start
    opt = make_inner(trial.inner, model, trial.lr)
    gen = torch.Generator().manual_seed(trial.seed * 1000 + rank)
    shared: Budget = ctx["shared"]
    budget = shared if trial.shared_budget else Budget(trial.total_steps // trial.workers)
    if clock is not None and trial.shared_budget:
        budget = Budget(trial.total_steps)  # a cap: the clock hands out the shared budget
    lossy = trial.drop_prob > 0
    cls = ClockedWorker if clock else LossyWorker if lossy else DiLoCoWorker
    worker = cls(
        model,
        opt,
        ctx["address"],
        sync_every=trial.sync_every,
        worker_id=f"w{rank}",
        # Clocked: no real-time heartbeats (DyLU's speeds come from the clock, report_speed).
        heartbeat_interval=0.0 if clock else 0.25,
        **trial.worker,
    )
    if isinstance(worker, ClockedWorker):
        assert clock is not None
        worker.clock, worker.rank = clock, rank
    ctx["start"].wait()
    try:
        with worker:
            joined, lost = _train(trial, rank, ctx, worker, model, opt, gen, budget, run)
    finally:
        if clock is not None:
            clock.finish(rank)
    ctx["results"][rank] = {
        "steps": ctx["steps"][rank],
        "lost_uploads": lost,
        "join_bytes_down": joined,
        **worker.sync_metrics,
    }
    if "final" in ctx:  # all-reduce mode: the replica is the model (every rank's is the same)
        ctx["final"][rank] = {
            n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters()
        }


def _train(
    trial: Trial,
    rank: int,
    ctx: dict[str, Any],
    worker: DiLoCoWorker,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    gen: torch.Generator,
    budget: Budget,
    run: ClockedRun | None,
) -> tuple[float, int]:
    """The training loop of ``worker_loop``, inside the worker's ``with``: the join's bytes down
    and the uploads lost."""
    corpus: Corpus = ctx["corpus"]
    drop_rng = random.Random(f"drop-{trial.seed}-{rank}")
    delay = trial.delays[rank] if trial.delays else 0.0
    per_worker = trial.total_steps // trial.workers
    lossy = trial.drop_prob > 0
    tokens = trial.batch_size * trial.seq_len
    clock = run.clock if run is not None else None
    steps = lost = 0
    # The join's download (full parameters): kept apart, so that a round's download is
    # the worker's bytes down less this, over its rounds.
    joined = worker.sync_metrics["bytes_down"]
    if run is not None and worker.settings.dylu:
        report_speed(worker, run.clock, rank, run.barrier)
    last_round = -1
    while budget.take() and (clock is None or clock.step(rank)):
        boundary = steps > 0 and steps % trial.sync_every == 0
        if trial.deadline and boundary and time.monotonic() > trial.deadline:
            ctx["stopped_early"] = True
            break
        if lossy and worker.base_round != last_round:
            # A round starts from the parameters just adopted: keep them, and draw whether
            # this round's upload will be lost.
            assert isinstance(worker, LossyWorker)
            last_round = worker.base_round
            worker.round_start = [p.detach().clone() for p in model.parameters()]
            worker.resume_own()  # after the snapshot is taken: it is the adopted global
            worker.lose_next = drop_rng.random() < trial.drop_prob
            lost += worker.lose_next
            if worker.lose_next:
                worker.report(samples=LOST_WEIGHT)
        progress = budget.done if trial.shared_budget else steps / max(per_worker, 1)
        if clock is not None and trial.shared_budget:
            progress = clock.progress(rank)
        for group in opt.param_groups:
            group["lr"] = trial.lr * lr_factor(trial, steps, progress)
        x, y = sample_batch(corpus.shards[rank], trial.batch_size, trial.seq_len, gen)
        loss = loss_on(model, x.to(trial.device), y.to(trial.device))
        loss.backward()
        if isinstance(worker, LossyWorker) and not worker.lose_next:
            worker.report(samples=tokens)
        # Counted before the step: its sync (inside the optimizer step, every sync_every
        # steps) waits for the round, and the curve watcher reads the count at the round's close.
        ctx["steps"][rank] = steps + 1
        opt.step()
        opt.zero_grad()
        steps += 1
        if "after_step" in ctx:
            ctx["after_step"](rank, worker, model)
        if run is not None:
            run.after_step(rank, worker)
        elif delay:
            time.sleep(delay)
    if isinstance(worker, LossyWorker):
        worker.resume_own()  # the last round's upload may have been lost too
    return joined, lost


def run_trial(trial: Trial) -> dict[str, Any]:
    """Run one configuration through a real server and ``trial.workers`` worker threads; the
    eval loss of the final global model and the run's metrics (and ``curve`` when asked)."""
    torch.set_num_threads(1)
    corpus = trial.corpus or build_corpus(trial.workers)
    model_fn = trial.model_fn or (lambda seed: build_model(seed, trial.seq_len))
    server_extra = dict(trial.server)
    if trial.drop_prob > 0:
        server_extra.setdefault("weighting", "samples")  # a lost upload weighs ~nothing
    config = ServerConfig(
        port=0, num_workers=trial.workers, heartbeat_timeout=0, stuck_timeout=0, **server_extra
    )
    # The server starts from the given or the model's initial parameters (every worker builds
    # the same ones from the seed), so no worker waits for another to upload them.
    init = trial.init or {n: p.detach().clone() for n, p in model_fn(trial.seed).named_parameters()}
    server = DiLoCoServer(config, initial_params=init).start()
    ctx: dict[str, Any] = {
        "corpus": corpus,
        "model_fn": model_fn,
        "address": server.address,
        "shared": Budget(trial.total_steps),
        "steps": [0] * trial.workers,
        "results": [{} for _ in range(trial.workers)],
        "start": threading.Barrier(trial.workers),
    }
    errors: list[BaseException] = []

    def work(rank: int) -> None:
        try:
            worker_loop(trial, rank, ctx)
        except BaseException as exc:  # reported by the caller
            errors.append(exc)
            ctx["start"].abort()

    run = _clocked(trial, server) if trial.clock is not None else None
    if run is not None:
        ctx["clock"] = run
        run.record(0.0)  # the start, as the watcher's first snapshot
    watcher = CurveWatcher(server, ctx["steps"]) if trial.curve and run is None else None
    t0 = time.monotonic()
    threads = [threading.Thread(target=work, args=(r,)) for r in range(trial.workers)]
    for t in threads:
        t.start()
    if watcher is not None:
        watcher.t0 = t0
        watcher.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    try:
        if errors:
            raise errors[0]
        _settle(server)
        if watcher is not None:
            watcher.stop_event.set()
            watcher.join()
            watcher.snap()
        if run is not None:
            # Uploads that landed after the last recorded event (a worker's leftover steps on
            # leaving): the final model is the curve's last point, as the table's figure.
            run.record(run.clock.end)
        status = server.status()
        model = model_fn(trial.seed).to(trial.device)
        server_params = server.global_params()
        model.load_state_dict(server_params)
        eval_loss = evaluate(model, corpus.eval.to(trial.device), trial.seq_len, trial.eval_windows)
    finally:
        server.stop()
    results = ctx["results"]
    row = {
        "name": trial.name,
        "seed": trial.seed,
        "eval_loss": eval_loss,
        "wall_s": wall,
        "updates": status["updates"],
        "bytes_up": status["bytes_in"],
        "bytes_down": status["bytes_out"],
        "staleness": status["staleness"],
        "workers": results,
        "steps": sum(r["steps"] for r in results),
    }
    if ctx.get("stopped_early"):
        row["stopped_early"] = True
    if watcher is not None:
        row["curve"] = evaluate_curve(trial, watcher.points, model, corpus)
    if run is not None:
        # Simulated time is the run's wall time; the real one is kept apart.
        row.update(real_s=wall, wall_s=run.clock.end, uploads=run.clock.uploads)
        row["params_sha256"] = params_digest(server_params)
        if trial.curve:
            row["curve"] = evaluate_curve(trial, run.points, model, corpus)
    return row


def _clocked(trial: Trial, server: DiLoCoServer) -> ClockedRun:
    """The simulated clock of a trial: ``trial.delays`` are the step costs."""
    assert trial.delays is not None and trial.drop_prob == 0, "a clock needs delays, no drops"
    sync = trial.server.get("mode", "sync") == "sync"
    clock = SimClock(
        trial.delays,
        trial.seed,
        ClockSettings(**trial.clock or {}),
        sync=sync,
        total=trial.total_steps if trial.shared_budget else None,
    )
    return ClockedRun(clock, server, trial.workers)


def _settle(server: DiLoCoServer, timeout: float = 10.0) -> None:
    """Wait until no upload is in flight or counted in a round still open: the workers' last
    uploads (a streaming fragment sent just before the end, say) may land after their threads
    have returned, and the final global model must include them."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = server.status()
        units = status.get("fragments") or [status]
        if not any(u.get("submitted") or u.get("uploading") for u in units):
            return
        time.sleep(0.02)


def evaluate_curve(
    trial: Trial, points: list[dict[str, Any]], model: torch.nn.Module, corpus: Corpus
) -> list[dict[str, Any]]:
    """Eval loss of every recorded global model. Inner steps per worker: in sync mode exactly
    ``updates * sync_every / P`` (P fragments, one outer update each per sync; never more than the
    steps taken), in async mode the steps the workers had taken when the update was seen, over
    the workers."""
    fragments = int(trial.worker.get("num_fragments", 1))
    sync = trial.server.get("mode", "sync") == "sync"
    eval_tokens = corpus.eval.to(trial.device)
    out = []
    for p in thin(points, trial.curve_points):
        model.load_state_dict(p.pop("params"))
        taken = p["worker_steps"] / trial.workers
        # Streaming workers hand in unsent fragments when they stop: updates past the last step.
        steps = min(p["updates"] * trial.sync_every / fragments, taken) if sync else taken
        out.append(
            {
                **p,
                "steps_per_worker": steps,
                "eval_loss": evaluate(model, eval_tokens, trial.seq_len, trial.curve_windows),
            }
        )
    return out
