"""The suite's protocol: model and data profiles, the iid split, the pretrain cache and the
baselines that need no server (plain AdamW on one worker, data-parallel at M times the batch).

Not run on its own; ``run.py`` uses it. Two profiles: ``cpu`` (the demo's 137k-parameter byte
transformer on ``pydoc_data.topics``, what the docs report) and ``gpu`` (a ~20M-parameter byte
transformer on CPython's own standard-library sources, for one GPU; not run for the docs).
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
from diloco.demo.data import Corpus, build_corpus, sample_batch, split_topic
from diloco.demo.model import CharTransformer, build_model, evaluate, loss_on


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
    data: str = "pydoc"  # "pydoc": pydoc_data.topics; "stdlib": CPython's .py sources
    max_bytes: int = 0  # stdlib: keep at most this many bytes of source (0: all)

    def model(self, seed: int) -> torch.nn.Module:
        """The model, initialised from ``seed`` alone (the global random state is kept)."""
        if self.data == "pydoc" and (self.d_model, self.layers, self.heads) == (64, 2, 4):
            return build_model(seed, self.seq_len)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return CharTransformer(self.d_model, self.layers, self.heads, self.seq_len)

    def corpus(self, workers: int, split: str) -> Corpus:
        """Training shards for ``workers`` workers, by topic (``non-iid``), along the text's main
        axis of byte statistics (``skewed``, ``splits.py``) or not (``iid``)."""
        return _corpus(self, workers, split)


@functools.lru_cache(maxsize=16)
def _corpus(profile: Profile, workers: int, split: str) -> Corpus:
    """``Profile.corpus``, built once per process (the tensors are never written to)."""
    base = build_corpus(workers) if profile.data == "pydoc" else stdlib_corpus(workers, profile)
    if split == "skewed":
        return skewed_corpus(base, workers)
    return base if split == "non-iid" else iid_corpus(base, workers)


CPU = Profile("cpu")
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
    data="stdlib",
)
PROFILES = {"cpu": CPU, "gpu": GPU}


def stdlib_corpus(workers: int, profile: Profile) -> Corpus:
    """CPython's standard-library sources as bytes, one topic per top-level module or package
    (tests and bundled tools left out); the tail of each topic held out, topics dealt to the
    shards largest first to the smallest shard (the demo corpus's rule)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    topics: dict[str, list[bytes]] = {}
    total = 0
    for path in sorted(glob.glob(str(root / "**" / "*.py"), recursive=True)):
        rel = Path(path).relative_to(root)
        if rel.parts[0] in ("test", "idlelib", "site-packages", "lib2to3") or "tests" in rel.parts:
            continue
        data = Path(path).read_bytes()
        topics.setdefault(rel.parts[0].removesuffix(".py"), []).append(data)
        total += len(data)
        if profile.max_bytes and total >= profile.max_bytes:
            break
    parts = []
    for name in sorted(topics):
        blob = bytearray(b"\n".join(topics[name]))
        train, held = split_topic(torch.frombuffer(blob, dtype=torch.uint8).long(), 0.1)
        if len(train) > profile.seq_len and len(held) > profile.seq_len:
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
    curve_windows: int = 128,
    eval_windows: int = 256,
    deadline: float = 0.0,
) -> dict[str, Any]:
    """A baseline with no server: one model, AdamW with the suite's warmup and cosine schedule,
    ``steps`` steps. ``replicas`` > 1 is data-parallel training's equivalent: each step's batch
    is one batch from each of the first ``replicas`` shards (M workers' gradients averaged, as
    an all-reduce would), so ``replicas`` times the batch. Its bytes are computed, not measured:
    every replica sends its fp32 gradient once per step. The curve is evaluated every
    ``curve_every`` steps (from copies, after the run). Past a ``deadline`` (``time.monotonic()``;
    0: none) it stops at the next curve point and says ``stopped_early``."""
    torch.set_num_threads(1)  # as each worker thread has it, so wall times compare
    model = profile.model(seed).to(profile.device)
    model.load_state_dict(init)
    trial = Trial(name, seed, lr=profile.lr, warmup=warmup, cosine=True)
    opt = torch.optim.AdamW(model.parameters(), lr=profile.lr)
    gen = torch.Generator().manual_seed(seed * 1000)
    grad_bytes = 4 * sum(p.numel() for p in model.parameters()) * replicas if replicas > 1 else 0
    snaps = [(0, 0.0, {n: t.clone() for n, t in init.items()})]
    t0 = time.monotonic()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = profile.lr * lr_factor(trial, step, step / steps)
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
                "eval_loss": evaluate(model, eval_tokens, profile.seq_len, curve_windows),
            }
        )
    return {
        "name": name,
        "seed": seed,
        "eval_loss": evaluate(model, eval_tokens, profile.seq_len, eval_windows),
        "wall_s": wall,
        "steps": taken * replicas,
        "steps_per_worker": taken,
        "bytes_up": grad_bytes * taken,
        "curve": curve,
        **({"stopped_early": True} if taken < steps else {}),
    }
