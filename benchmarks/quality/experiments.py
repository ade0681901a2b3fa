"""The suite's named experiments, one per claim or group of claims (issue 20, a-m), each with a
default scale (the docs' figures) and a fast one (the test's).

Not run on its own: ``python benchmarks/quality/run.py NAME [--fast]``. An experiment is a list
of configurations; ``rows.run_config`` runs one, through the real server and worker threads
or, for the baselines, a single model with no server. Rows are cached by their full settings, so
a configuration shared by several experiments (DiLoCo at the default M and H is the reference of
most) runs once per seed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from benchmarks.quality.reach import TIMED

# The worker speeds of arXiv 2401.09135, section 4: seconds per step relative to a unit.
ASYNC_RATIO = (0.58, 0.75, 1.51, 3.33)
# Delayed Nesterov's outer lrs tried (the paper tunes its async runs'): ``async_lr``'s rows. On
# the old 137k-parameter profile (eval split, 2026-11-27) 0.5 was the best of these; the async
# rows now take the choice ``tuning.run_outer_sweep`` makes on the validation split.
ASYNC_OUTER_LRS = (0.3, 0.5, 0.7, 1.0)


@dataclass(frozen=True)
class Scale:
    """How big an experiment runs: the default for the docs, ``FAST`` for the test.

    Sized by cost (issue 32): ``python benchmarks/quality/run.py --plan MS`` projects the default
    command's time from the inner steps of its distinct rows at MS milliseconds per step (about 34
    for the CPU profile on one core of this project's 2-core machine); docs/quality.md prints the
    measured time."""

    steps: int = 320  # inner steps per worker (the "equal steps per worker" budget)
    sync_every: int = 16  # H, a multiple of every fragment count used: 20 outer steps
    # Claim c: H swept over a run of sweep_steps, a multiple of the largest H giving it 20 outer
    # steps (at H = 250 in a 500-step run the old suite's largest H had two, so H mostly set
    # the number of outer steps); the smallest H = 5 is a quarter of the default H.
    sweep_steps: int = 800
    sweep: tuple[int, ...] = (5, 10, 20, 40)
    workers: int = 4  # M where an experiment does not vary it
    worker_counts: tuple[int, ...] = (1, 2, 4, 8)
    taus: tuple[int, ...] = (1, 2, 4)  # overlaps of claim i
    fragments: tuple[int, ...] = (2, 4)
    pretrain_steps: int = 1000
    warmup: int = 40
    # Async experiments run on a simulated clock (harness/sim_clock.py): worker k's step costs
    # unit x ASYNC_RATIO[k] simulated seconds x a seeded jitter in [1 - jitter, 1 + jitter];
    # async workers wait ``async_grace`` units between upload and download (the grace period).
    async_unit: float = 0.01
    async_jitter: float = 0.1
    async_grace: float = 1.0
    # Delayed Nesterov's outer lrs tried (tuning.run_outer_sweep) on the validation split, seed
    # 0, for async + DN + DyLU; the async rows take the best.
    async_lrs: tuple[float, ...] = ASYNC_OUTER_LRS
    # Held-out windows (of the profile's context) every loss is measured on: the curves' points
    # and the final model's alike, so the last curve point is the table's figure.
    windows: int = 256
    # At most this many curve points evaluated per row (0: every outer update): one evaluation
    # costs about 10 inner steps of compute, so at H = 5 every update's would double a row's cost.
    curve_points: int = 10
    # The inner lr sweep (tuning.py): a log grid, tried for tune_steps per worker on seed 0. Six
    # points: on 1e-3 to 8e-3 (2026-11-27) DiLoCo M=1 chose the lowest and data-parallel at 4x
    # the batch the highest, so the grid was widened by one step at each end.
    lrs: tuple[float, ...] = (5e-4, 1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2)
    tune_steps: int = 128
    seeds: tuple[int, ...] = (0, 1)
    muon_workers: tuple[int, ...] = (1, 4, 8)  # M of the Muon rows (muon.py)
    muon_batch: int = 32  # their global batch per inner step, split over the M workers (4 at M=8)
    # Claim q (quorum.py): real seconds three workers sleep after each step (the straggler 4x).
    # Sleeps must outweigh the step's compute (about 0.07 s with four threads on two cores) for
    # the straggler to be clearly slower; 0.05 makes it about 2.3x slower, at 1.5 min per row.
    quorum_unit: float = 0.05


DEFAULT = Scale()
FAST = Scale(
    steps=12,
    sweep_steps=12,
    sync_every=4,
    workers=2,
    worker_counts=(1, 2),
    sweep=(4, 12),
    taus=(1,),
    fragments=(2,),
    pretrain_steps=5,
    warmup=2,
    async_lrs=(0.5, 1.0),
    windows=8,
    curve_points=0,
    lrs=(1e-3, 3e-3),
    tune_steps=4,
    seeds=(0,),
    muon_workers=(1, 2),
    muon_batch=4,
    quorum_unit=0.001,
)


@dataclass(frozen=True)
class Config:
    """One configuration of an experiment (run once per seed)."""

    name: str
    kind: str = "diloco"  # "diloco" (server and workers), "adamw" (one model), "dp"
    workers: int = 4
    sync_every: int = 20
    steps: int = 300  # inner steps per worker (async: the run's total over the workers)
    split: str = "non-iid"
    server: dict[str, Any] = field(default_factory=dict)
    worker: dict[str, Any] = field(default_factory=dict)
    delays: tuple[float, ...] | None = None  # per-step costs (simulated with ``clock``)
    clock: dict[str, float] = field(default_factory=dict)  # sim_clock.ClockSettings; {}: sleeps
    shared_budget: bool = False
    drop_prob: float = 0.0
    replicas: int = 1  # "dp": batches per step, one from each of this many shards
    inner: str = "adamw"  # the workers' inner optimizer ("adamw", "muon": harness/inner.py)
    batch_size: int = 0  # sequences per worker per inner step (0: the profile's)
    equal_tokens: bool = False  # "adamw": the equal-tokens baseline (its own tuned lr)
    lr: float | None = None  # peak inner lr; None: not yet chosen (tuning.with_lr sets it)
    heldout: str = "test"  # what eval_loss is measured on: "test", or "valid" (the lr sweeps)


def plain(s: Scale, name: str = "", **changes: Any) -> Config:
    """DiLoCo with M = ``s.workers`` at H = ``s.sync_every``, outer Nesterov 0.7 / 0.9."""
    base = Config(
        name or f"DiLoCo M={s.workers}", workers=s.workers, sync_every=s.sync_every, steps=s.steps
    )
    return replace(base, **changes)


def adamw(s: Scale, steps: int, name: str) -> Config:
    """Plain AdamW on one worker with all the training text (no server)."""
    return Config(name, kind="adamw", workers=1, sync_every=s.sync_every, steps=steps)


def scaling(s: Scale) -> list[Config]:
    """Claims a, b: M workers at equal steps per worker, against one worker at equal steps and
    at equal total tokens (M times the steps)."""
    out = [adamw(s, s.steps, "AdamW, 1 worker (equal steps)")]
    out += [plain(s, f"DiLoCo M={m}", workers=m) for m in s.worker_counts]
    for m in s.worker_counts[1:]:
        name = f"AdamW, 1 worker, {m}x steps (equal tokens to M={m})"
        out.append(replace(adamw(s, s.steps * m, name), equal_tokens=True))
    return out


def sync_every(s: Scale) -> list[Config]:
    """Claim c: the sync interval H swept with M workers (the default M) over a longer run
    (a multiple of the largest H), beside AdamW on one worker for the same steps."""
    out = [plain(s, f"H={h}", sync_every=h, steps=s.sweep_steps) for h in s.sweep]
    out.append(adamw(s, s.sweep_steps, "AdamW, 1 worker (equal steps)"))
    return out


def sync_every_lr(s: Scale) -> list[Config]:
    """Claim c's smallest H tried at half the outer lr (seed 0, not for the verdict): whether
    the smallest H's loss comes from its many outer Nesterov steps at lr 0.7 (the paper tuned
    0.7 at H = 500 and swept H from 50 up)."""
    h = min(s.sweep)
    server = {"outer_lr": 0.35}
    return [plain(s, f"H={h}, outer lr 0.35", sync_every=h, steps=s.sweep_steps, server=server)]


def outer(s: Scale) -> list[Config]:
    """Claim d: outer Nesterov against plain averaging (SGD lr 1, no momentum) and SGD with
    (heavy-ball) momentum at the same lr and momentum as Nesterov."""
    return [
        plain(s, "Nesterov (lr 0.7, momentum 0.9)"),
        plain(
            s, "averaging (SGD lr 1, no momentum)", server={"outer_lr": 1.0, "outer_momentum": 0.0}
        ),
        plain(s, "SGD momentum (lr 0.7, 0.9, not Nesterov)", server={"nesterov": False}),
    ]


def single_worker(s: Scale) -> list[Config]:
    """Claim e: DiLoCo with one worker (an outer Nesterov step on its own pseudo-gradient every H
    steps) against plain AdamW on the same data for the same steps."""
    return [adamw(s, s.steps, "AdamW, 1 worker (equal steps)"), plain(s, "DiLoCo M=1", workers=1)]


def _async_common(s: Scale, grace: float = 0.0) -> dict[str, Any]:
    """Four workers at the paper's speed ratios on the simulated clock."""
    clock = {"jitter": s.async_jitter, **({"grace": grace * s.async_unit} if grace else {})}
    return {"workers": 4, "delays": tuple(s.async_unit * r for r in ASYNC_RATIO), "clock": clock}


def _async_row(
    s: Scale,
    name: str,
    lr: float | None = None,
    dn: bool = True,
    dylu: bool = True,
    timed: bool = False,
) -> Config:
    """An async row: the shared budget of ``s.steps`` per worker (``timed``: instead, the time
    sync's slowest worker takes for its steps), the grace period, the outer lr (None: none of its
    own, so ``tuning.with_outer_lr`` gives it the outer sweep's choice)."""
    server = {"mode": "async", "delayed_nesterov": dn, "dylu": dylu}
    if lr is not None:
        server["outer_lr"] = lr
    common = _async_common(s, s.async_grace)
    steps = s.steps * 4 * (10 if timed else 1)  # timed: a cap the time budget never reaches
    if timed:
        common["clock"]["until"] = s.steps * s.async_unit * max(ASYNC_RATIO)
    return plain(
        s, name, server=server, worker={"dylu": dylu}, steps=steps, shared_budget=True, **common
    )


def asynchronous(s: Scale) -> list[Config]:
    """Claims f, g: four workers at the paper's speed ratios (a step costs 0.58, 0.75, 1.51 or
    3.33 units of simulated time), the same total inner steps for all (sync splits them evenly
    and each round lasts as long as its slowest worker; async lets fast workers take more); the
    async rows wait a grace period between upload and download; DN's outer lr is the one the
    outer sweep (``async_lr``, validation split) chose (naive async keeps sync's 0.7). Claim g's
    row trains for sync's time, not its steps (loss against wall time)."""
    return [
        plain(s, "sync", **_async_common(s)),
        _async_row(s, "async (naive)", 0.7, dn=False, dylu=False),
        _async_row(s, "async + DN", dylu=False),
        _async_row(s, "async + DN + DyLU"),
        _async_row(s, TIMED, timed=True),
    ]


def async_iid(s: Scale) -> list[Config]:
    """Claim f's extra try (seed 0, not for the verdict): sync and async + DN + DyLU again on the
    iid split, to test whether async's gap comes from the non-iid shards (fast workers take
    most of the shared budget, so their topics dominate the updates)."""
    return [
        replace(c, name=f"{c.name}, iid split", split="iid")
        for c in asynchronous(s)
        if c.name in ("sync", "async + DN + DyLU")
    ]


def async_lr(s: Scale) -> list[Config]:
    """The outer sweep's rows: async + DN + DyLU at each outer lr of ``s.async_lrs``, measured on
    the validation split (``tuning.run_outer_sweep`` runs them on seed 0; no verdict)."""
    return [
        replace(_async_row(s, f"async + DN + DyLU, outer lr {x:g}", x), heldout="valid")
        for x in s.async_lrs
    ]


def streaming(s: Scale) -> list[Config]:
    """Claim h: P fragments, sequential and strided, no overlap (tau 0, alpha 0: each fragment
    is replaced by its global value, as plain DiLoCo replaces the model)."""
    out = [plain(s)]
    for p in s.fragments:
        for pattern in ("sequential", "strided"):
            worker = {"num_fragments": p, "fragment_pattern": pattern, "merge_alpha": 0.0}
            out.append(plain(s, f"P={p} {pattern}", worker=worker))
    return out


def overlap(s: Scale) -> list[Config]:
    """Claim i, as Streaming DiLoCo's figure 8 runs it: the largest fragment count P, strided,
    with overlap tau (a fragment's result merged tau inner steps after it was sent, training going
    on meanwhile: local = alpha * local + (1 - alpha) * global) for alpha 0.5 and alpha 0, against
    the same fragments without overlap (tau 0, alpha 0). A control: tau 0 with alpha 0.5."""
    p = max(s.fragments)
    base = {"num_fragments": p, "fragment_pattern": "strided"}
    out = [plain(s, f"P={p} strided", worker={**base, "merge_alpha": 0.0})]
    for alpha in (0.5, 0.0):
        for tau in s.taus:
            worker = {**base, "overlap_steps": tau, "merge_alpha": alpha}
            out.append(plain(s, f"P={p} strided, tau={tau}, alpha={alpha}", worker=worker))
    worker = {**base, "overlap_steps": 0, "merge_alpha": 0.5}
    out.append(plain(s, f"P={p} strided, tau=0, alpha=0.5 (control)", worker=worker))
    return out


def codecs(s: Scale) -> list[Config]:
    """Claim j: uplink codecs fp32 (reference), bf16 (the default), int8 and int4 with error
    feedback; the downlink full fp32 parameters."""
    out = [plain(s, "fp32", worker={"codec": "fp32"}), plain(s, "bf16 (default)")]
    out += [plain(s, f"{c} + error feedback", worker={"codec": c}) for c in ("int8", "int4")]
    return out


# Issue 30's sparse codec at SparseLoCo's density (1/64: 1.56%) with 2-bit values. Chunk 1024,
# not the paper's 4096: the paper's matrices hold hundreds of its chunks, ours 4096 to 16384
# elements, so at 4096 a chunk would be a whole matrix (a per-tensor top-k); at 1024 each has
# 4 to 16, for about 5% more bytes (a bf16 scale per 16 kept values instead of per 64).
TOPK = "topk:density=0.0156,chunk=1024,bits=2"
# The SparseLoCo rule's outer lr: 4 = M. Where only one of the M workers kept a position (most
# positions: their supports overlap little), the mean divides its value by M; lr M undoes that. Chosen on seed 0
# from sparse_lr, the best of 0.7 to 16 there (docs/quality.md has the sweep).
SPARSELOCO_LR = 4.0
SPARSELOCO_LRS = (0.7, 1.0, 2.0, 4.0, 8.0, 16.0)


def sparseloco(lr: float = SPARSELOCO_LR, **extra: Any) -> dict[str, Any]:
    """The server settings of the SparseLoCo rule at outer lr ``lr``."""
    return {"outer_rule": "sparseloco", "outer_lr": lr, **extra}


def sparse(s: Scale) -> list[Config]:
    """Claim n (issue 30, SparseLoCo's recipe): uplink `topk` at density 0.0156 (chunks of 1024,
    2-bit values) with error feedback, under outer Nesterov (lr 0.7, momentum 0.9) and under the
    SparseLoCo rule (plain averaged descent, outer lr 4, error feedback decayed by 0.95 in place of
    momentum), the latter also with the sparse downlink (the round's changed positions and their
    new values instead of full parameters); fp32 up and down is the reference."""
    topk = {"codec": TOPK}
    return [
        plain(s, "fp32", worker={"codec": "fp32"}),
        plain(s, "topk + EF, Nesterov", worker=topk),
        plain(s, "topk + EF, SparseLoCo rule", server=sparseloco(), worker=topk),
        plain(
            s,
            "topk + EF, SparseLoCo rule, sparse downlink",
            server=sparseloco(download_codec="sparse"),
            worker=topk,
        ),
    ]


def sparse_lr(s: Scale) -> list[Config]:
    """Claim n's settings tried on seed 0 (not used for its verdict): the SparseLoCo rule's outer
    lr, `topk` with the paper's chunk of 4096 under Nesterov, and fp32 and `topk` under the
    SparseLoCo rule with four times the rounds (H a quarter of the default, same steps)."""
    topk = {"codec": TOPK}
    out = [plain(s, "fp32", worker={"codec": "fp32"})]
    out += [
        plain(s, f"topk + EF, SparseLoCo rule, outer lr {lr}", server=sparseloco(lr), worker=topk)
        for lr in SPARSELOCO_LRS
    ]
    chunk4096 = {"codec": TOPK.replace("chunk=1024", "chunk=4096")}
    out.append(plain(s, "topk chunk 4096 + EF, Nesterov", worker=chunk4096))
    h = max(s.sync_every // 4, 1)
    out.append(plain(s, f"fp32, H={h}", sync_every=h, worker={"codec": "fp32"}))
    name = f"topk + EF, SparseLoCo rule, H={h}"
    out.append(plain(s, name, sync_every=h, server=sparseloco(), worker=topk))
    return out


def allreduce_codecs(s: Scale) -> list[Config]:
    """Claim o (issue 30 item 4): all-reduce mode (no parameter server: the workers average
    among themselves and each runs the outer Nesterov step on its replica) with int8 collectives
    (reduce-scatter of quantized blocks, fp32 sums, requantized all-gather) and error feedback
    on each member, against fp32 collectives."""
    ring = {"allreduce": True}
    return [
        plain(s, "fp32 all-reduce", server=ring, worker={"codec": "fp32"}),
        plain(s, "int8 all-reduce + EF", server=ring, worker={"codec": "int8"}),
    ]


def dropped(s: Scale) -> list[Config]:
    """Claim k: each worker's upload of each round lost with probability 0.5."""
    return [plain(s, "no uploads lost"), plain(s, "50% of uploads lost", drop_prob=0.5)]


def iid(s: Scale) -> list[Config]:
    """Claim l: a clearly non-iid split (pieces of the text ordered along its main axis of byte
    statistics, one run per worker: splits.py) against an iid split of the same text, with the
    by-package split (the other experiments', the same row as scaling's M=4: cached) beside them."""
    skewed = plain(s, "non-iid (skewed by byte statistics)", split="skewed")
    return [skewed, plain(s, "iid", split="iid"), plain(s, "non-iid (by package)")]


def data_parallel(s: Scale) -> list[Config]:
    """Claim m: DiLoCo M workers against data-parallel training with M times the batch (one
    batch from each worker's shard per step), at equal steps and equal tokens."""
    dp = Config(
        f"data-parallel, {s.workers}x batch",
        kind="dp",
        workers=1,
        sync_every=s.sync_every,
        steps=s.steps,
        replicas=s.workers,
    )
    return [plain(s), dp]


@dataclass(frozen=True)
class Experiment:
    name: str
    claims: str
    configs: Callable[[Scale], list[Config]]
    what: str  # "equal steps per worker", "equal total tokens", ...
    scale: Scale | None = None  # its own default scale (None: DEFAULT); --fast runs FAST
    default: bool = True  # False: not for a verdict, run only when named (or with --fast)
    # The first configuration is the reference the others are compared with, paired by seed.


EQUAL_STEPS = "equal steps per worker"
EXPERIMENTS = {
    e.name: e
    for e in [
        Experiment("scaling", "ab", scaling, EQUAL_STEPS + "; equal tokens in the 'Nx steps' rows"),
        Experiment("sync_every", "c", sync_every, EQUAL_STEPS),
        Experiment("sync_every_lr", "c", sync_every_lr, EQUAL_STEPS, default=False),
        Experiment("outer", "d", outer, EQUAL_STEPS),
        Experiment("single_worker", "e", single_worker, "equal steps (= equal tokens)"),
        Experiment("async", "fg", asynchronous, "equal total inner steps over all workers"),
        Experiment("async_iid", "f", async_iid, "equal total inner steps", default=False),
        Experiment("streaming", "h", streaming, EQUAL_STEPS),
        Experiment("overlap", "i", overlap, EQUAL_STEPS),
        Experiment("codecs", "j", codecs, EQUAL_STEPS),
        Experiment("sparse", "n", sparse, EQUAL_STEPS),
        Experiment("sparse_lr", "n", sparse_lr, EQUAL_STEPS, default=False),
        Experiment("allreduce_codecs", "o", allreduce_codecs, EQUAL_STEPS),
        Experiment("dropped", "k", dropped, EQUAL_STEPS),
        Experiment("iid", "l", iid, EQUAL_STEPS),
        Experiment("data_parallel", "m", data_parallel, "equal steps and equal tokens"),
    ]
}
