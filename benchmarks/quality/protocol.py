"""The suite's protocol: model and data profiles, the iid split, the pretrain cache and the
baselines that need no server (plain AdamW on one worker, data-parallel at M times the batch).

Not run on its own; ``run.py`` uses it. Both profiles train byte-level transformers on CPython's
own standard-library sources: ``cpu`` (about 0.67M parameters, what the docs report; issue 32
retired the demo's 137k-parameter model on ``pydoc_data.topics``, whose baselines were starved at
one small lr) and ``gpu`` (about 19M, for one GPU). ``FAST`` is a toy of ``cpu`` for the tests.
Every topic's tail is held out twice: a validation split that chooses the inner lr
(``tuning.py``) and, after it, the test split every verdict is judged on.
"""

from __future__ import annotations

import functools
import glob
import hashlib
import json
import os
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness.trials import Trial, lr_factor
from benchmarks.quality.splits import skewed_corpus
from diloco.demo.data import Corpus, sample_batch, split_topic
from diloco.demo.model import CharTransformer, evaluate, loss_on


@dataclass(frozen=True)
class Profile:
    """What a run trains and on what: the model, its data, batch and inner optimizer."""

    name: str
    d_model: int = 64
    layers: int = 2
    heads: int = 4
    seq_len: int = 64
    batch_size: int = 16
    lr: float = 3e-3
    device: str = "cpu"
    max_bytes: int = 0  # keep at most this many bytes of source in all (0: all)
    topic_bytes: int = 0  # keep at most this many bytes of each topic (0: all)

    def model(self, seed: int) -> torch.nn.Module:
        """The model, initialised from ``seed`` alone (the global random state is kept)."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return CharTransformer(self.d_model, self.layers, self.heads, self.seq_len)

    def corpus(self, workers: int, split: str, heldout: str = "test") -> Corpus:
        """Training shards for ``workers`` workers, by topic (``non-iid``), along the text's main
        axis of byte statistics (``skewed``, ``splits.py``) or not (``iid``); ``Corpus.eval`` is
        the ``heldout`` split: ``test`` (verdicts) or ``valid`` (the lr sweep)."""
        if heldout not in HELDOUT:
            raise ValueError(f"heldout must be one of {', '.join(HELDOUT)}, got {heldout!r}")
        if split not in SPLITS:
            raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
        return _corpus(self, workers, split, heldout)


# Fractions of every topic held out, taken from its tail: the test split last, validation before.
HELDOUT = {"test": 0.10, "valid": 0.05}
SPLITS = ("non-iid", "skewed", "iid")


@functools.lru_cache(maxsize=8)
def _corpus(profile: Profile, workers: int, split: str, heldout: str) -> Corpus:
    """``Profile.corpus``, built once per process (the tensors are never written to)."""
    base = stdlib_corpus(workers, profile, heldout)
    if split == "skewed":
        return skewed_corpus(base, workers)
    return base if split == "non-iid" else iid_corpus(base, workers)


# About 0.67M parameters (3 blocks of width 128: 12 x 128^2 each, plus embeddings and head), five
# times the old demo model's, a 64-byte context, 8 sequences per step. Sized by step time, one core
# of this project's 2-core machine (load about 10): 34 ms, where 4 blocks take 45 ms and width 192
# (1.9M) 80 ms, which would put the default suite at about 69 and 120 minutes instead of about 45
# (run.py --plan). Every topic is capped at 48 kB: the text stays diverse (the `encodings`
# tables would otherwise be a tenth of it) and its int64 tensors small (4 MB of training text).
CPU = Profile(
    "cpu", d_model=128, layers=3, heads=4, seq_len=64, batch_size=8, lr=2e-3, topic_bytes=48_000
)
# A toy of CPU for the tests (--fast): the same code paths in seconds.
FAST = Profile(
    "cpu-fast", d_model=32, layers=1, heads=2, seq_len=32, batch_size=4, max_bytes=400_000
)
# About 19M parameters (6 blocks of width 512: 12 x 512^2 each, plus embeddings and head).
GPU = Profile(
    "gpu",
    d_model=512,
    layers=6,
    heads=8,
    seq_len=256,
    batch_size=32,
    lr=6e-4,
    device="cuda",
)
PROFILES = {"cpu": CPU, "gpu": GPU}


def stdlib_corpus(workers: int, profile: Profile, heldout: str = "test") -> Corpus:
    """CPython's standard-library sources as bytes, one topic per top-level module or package
    (tests and bundled tools left out), each cut to ``profile.topic_bytes``; the tail of each
    topic held out (its last tenth the test split, the twentieth before it the validation split,
    neither trained on), topics dealt to the shards largest first to the smallest shard (the
    demo corpus's rule). ``Corpus.eval`` is the ``heldout`` split."""
    root = Path(sysconfig.get_paths()["stdlib"])
    topics: dict[str, list[bytes]] = {}
    total = 0
    for path in sorted(glob.glob(str(root / "**" / "*.py"), recursive=True)):
        rel = Path(path).relative_to(root)
        if rel.parts[0] in ("test", "idlelib", "site-packages", "lib2to3") or "tests" in rel.parts:
            continue
        topic = topics.setdefault(rel.parts[0].removesuffix(".py"), [])
        if profile.topic_bytes and sum(map(len, topic)) >= profile.topic_bytes:
            continue  # capped below: no need to read it
        data = Path(path).read_bytes()
        topic.append(data)
        total += len(data)
        if profile.max_bytes and total >= profile.max_bytes:
            break
    parts = []
    for name in sorted(topics):
        blob = bytearray(b"\n".join(topics[name]))
        if profile.topic_bytes:
            blob = blob[: profile.topic_bytes]
        rest, test = split_topic(torch.frombuffer(blob, dtype=torch.uint8).long(), HELDOUT["test"])
        share = HELDOUT["valid"] / (1 - HELDOUT["test"])
        train, valid = split_topic(rest, share)
        held = test if heldout == "test" else valid
        if len(train) > profile.seq_len and min(len(valid), len(test)) > profile.seq_len:
            parts.append((train, held))
    shards: list[list[torch.Tensor]] = [[] for _ in range(workers)]
    sizes = [0] * workers
    for train, _ in sorted(parts, key=lambda p: -len(p[0])):
        i = sizes.index(min(sizes))
        shards[i].append(train)
        sizes[i] += len(train)
    return Corpus(
        shards=[torch.cat(s) for s in shards],
        train=torch.cat([t for t, _ in parts]),
        eval=torch.cat([h for _, h in parts]),
    )


def iid_corpus(corpus: Corpus, workers: int, chunk: int = 1024) -> Corpus:
    """The same training and held-out text, dealt to ``workers`` shards without regard to topic:
    the training text cut into ``chunk``-token pieces, shuffled by a fixed permutation (the same
    for every seed, as the topic split is) and dealt round-robin."""
    pieces = list(corpus.train.split(chunk))
    order = torch.randperm(len(pieces), generator=torch.Generator().manual_seed(1234))
    shards = [torch.cat([pieces[int(i)] for i in order[w::workers]]) for w in range(workers)]
    return Corpus(shards=shards, train=corpus.train, eval=corpus.eval)


def cache_key(**fields: Any) -> str:
    """A short stable hash of ``fields`` (names of cached files)."""
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def pretrained(profile: Profile, seed: int, steps: int, cache_dir: Path) -> dict[str, torch.Tensor]:
    """The parameters after ``steps`` of single-worker AdamW on all the training text (linear
    warmup over the first tenth, then a constant lr), from the model built from ``seed``.
    Computed once per profile, seed and step count, then read from ``cache_dir``."""
    key = cache_key(profile=asdict(profile), seed=seed, steps=steps, kind="pretrain")
    path = cache_dir / f"pretrain-{profile.name}-s{seed}-{key}.pt"
    if path.exists():
        return torch.load(path, map_location="cpu", weights_only=True)
    torch.set_num_threads(1)  # as the workers: two threads on a busy 2-core machine crawl
    model = profile.model(seed).to(profile.device)
    trial = Trial("pretrain", seed, lr=profile.lr, warmup=max(steps // 10, 1))
    corpus = profile.corpus(1, "non-iid")
    opt = torch.optim.AdamW(model.parameters(), lr=profile.lr)
    gen = torch.Generator().manual_seed(10_000 + seed)
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = profile.lr * lr_factor(trial, step, 0.0)
        x, y = sample_batch(corpus.train, profile.batch_size, profile.seq_len, gen)
        loss_on(model, x.to(profile.device), y.to(profile.device)).backward()
        opt.step()
        opt.zero_grad()
    params = {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters()}
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(params, tmp)
    os.replace(tmp, path)  # never a half-written cache file
    return params


def run_single(
    name: str,
    profile: Profile,
    seed: int,
    init: dict[str, torch.Tensor],
    corpus: Corpus,
    *,
    steps: int,
    warmup: int,
    replicas: int = 1,
    curve_every: int = 25,
    windows: int = 256,
    lr: float | None = None,
    curve_points: int = 0,
    deadline: float = 0.0,
) -> dict[str, Any]:
    """A baseline with no server: one model, AdamW with the suite's warmup and cosine schedule,
    ``steps`` steps. ``replicas`` > 1 is data-parallel training's equivalent: each step's batch
    is one batch from each of the first ``replicas`` shards (M workers' gradients averaged, as
    an all-reduce would), so ``replicas`` times the batch. Its bytes are computed, not measured:
    every replica sends its fp32 gradient once per step. The curve is evaluated every
    ``curve_every`` steps (from copies, after the run) on the same ``windows`` held-out windows as
    the final model, and at most ``curve_points`` times (0: no limit; the interval grows to fit).
    ``lr``: the peak inner lr (default the profile's). Past a ``deadline`` (``time.monotonic()``;
    0: none) it stops at the next curve point and says ``stopped_early``."""
    lr = profile.lr if lr is None else lr
    if curve_points:
        curve_every = max(curve_every, -(-steps // curve_points))
    torch.set_num_threads(1)  # as each worker thread has it, so wall times compare
    model = profile.model(seed).to(profile.device)
    model.load_state_dict(init)
    trial = Trial(name, seed, lr=lr, warmup=warmup, cosine=True)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed * 1000)
    grad_bytes = 4 * sum(p.numel() for p in model.parameters()) * replicas if replicas > 1 else 0
    snaps = [(0, 0.0, {n: t.clone() for n, t in init.items()})]
    t0 = time.monotonic()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr * lr_factor(trial, step, step / steps)
        batches = [
            sample_batch(corpus.shards[r], profile.batch_size, profile.seq_len, gen)
            for r in range(replicas)
        ]
        x = torch.cat([b[0] for b in batches]).to(profile.device)
        y = torch.cat([b[1] for b in batches]).to(profile.device)
        loss_on(model, x, y).backward()
        opt.step()
        opt.zero_grad()
        if (step + 1) % curve_every == 0 or step + 1 == steps:
            params = {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters()}
            snaps.append((step + 1, time.monotonic() - t0, params))
            if deadline and time.monotonic() > deadline:
                break
    wall = time.monotonic() - t0
    taken = snaps[-1][0]  # the last snapshot is the final model (a deadline may cut the run)
    eval_tokens = corpus.eval.to(profile.device)
    curve = []
    for done, at, params in snaps:
        model.load_state_dict(params)
        curve.append(
            {
                "steps_per_worker": done,
                "bytes_up": grad_bytes * done,
                "wall_s": at,
                "eval_loss": evaluate(model, eval_tokens, profile.seq_len, windows),
            }
        )
    return {
        "name": name,
        "seed": seed,
        "eval_loss": evaluate(model, eval_tokens, profile.seq_len, windows),
        "wall_s": wall,
        "steps": taken * replicas,
        "steps_per_worker": taken,
        "bytes_up": grad_bytes * taken,
        "curve": curve,
        **({"stopped_early": True} if taken < steps else {}),
    }
