"""How non-iid a data split is, and a split that is clearly non-iid (issue 32, claim l).

The measure: a shard's byte-frequency divergence, KL(shard || all training text) in nats over the
256 byte values (every count plus one half, so no frequency is zero). On ``pydoc_data.topics``
with four workers the topic split (whole topics per worker) gives 0.008 to 0.012 per shard and
the iid split 0.001 to 0.004: the help topics are all English prose about Python, so dealing
whole topics barely skews what each worker sees. On the CPU profile's stdlib sources (every
top-level package cut to 48 kB) the by-package split gives 0.002 to 0.005, the iid split 0.0004 to
0.0005, and the skewed split 0.003 to 0.050 (2026-11-27, four workers).

The ``skewed`` split (``skewed_corpus``) skews it on purpose, from the same training text: the
text is cut into ``chunk``-byte pieces, each piece is placed on the first principal axis of the
pieces' byte statistics (square roots of their byte frequencies, centred), and the pieces, in
that order, are cut into ``workers`` runs of equal size. Each worker gets one end of the main axis
along which the text's pieces differ (prose against code, say), so its bytes are as unlike the
others' as one cut allows. The held-out text is untouched.
"""

from __future__ import annotations

from typing import Any

import torch

from diloco.demo.data import Corpus

CHUNK = 4096  # bytes per piece: about 80 in the demo corpus, 2,700 in the stdlib sources


def byte_frequencies(tokens: torch.Tensor) -> torch.Tensor:
    """The 256 byte frequencies of ``tokens`` (int64 bytes), each count plus one half (float64)."""
    counts = torch.bincount(tokens, minlength=256).double() + 0.5
    return counts / counts.sum()


def divergence(tokens: torch.Tensor, reference: torch.Tensor) -> float:
    """KL(bytes of ``tokens`` || bytes of ``reference``) in nats."""
    p, q = byte_frequencies(tokens), byte_frequencies(reference)
    return float((p * (p / q).log()).sum())


def shard_divergences(corpus: Corpus) -> list[float]:
    """Each shard's divergence from all the training text."""
    return [divergence(s, corpus.train) for s in corpus.shards]


def skewed_corpus(corpus: Corpus, workers: int, chunk: int = CHUNK) -> Corpus:
    """``corpus``'s training text in ``workers`` shards along its main axis of byte statistics
    (the module's docstring); the same held-out text. Deterministic."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    pieces = list(corpus.train.split(chunk))
    if len(pieces) < workers:
        raise ValueError(f"{len(pieces)} pieces of {chunk} bytes cannot fill {workers} shards")
    features = torch.stack([byte_frequencies(p).sqrt() for p in pieces])
    features -= features.mean(dim=0)
    axis = torch.linalg.svd(features, full_matrices=False).Vh[0]
    axis *= torch.sign(axis[int(axis.abs().argmax())])  # the SVD's sign is arbitrary: fix it
    position = (features @ axis).tolist()
    order = sorted(range(len(pieces)), key=lambda i: (position[i], i))
    total = sum(len(p) for p in pieces)
    members: list[list[torch.Tensor]] = [[] for _ in range(workers)]
    seen = 0
    for i in order:
        # The shard whose equal share of the text this piece starts in.
        members[min(seen * workers // total, workers - 1)].append(pieces[i])
        seen += len(pieces[i])
    if any(not m for m in members):
        raise ValueError(f"pieces of {chunk} bytes are too few for {workers} shards")
    return Corpus(shards=[torch.cat(m) for m in members], train=corpus.train, eval=corpus.eval)


def divergence_lines(result: dict[str, Any]) -> list[str]:
    """The page's lines giving each split's divergences, when an experiment's configurations
    differ in their split (claim l's); none otherwise."""
    splits = {r["config"]["split"]: r for r in result["rows"] if "shard_divergence" in r}
    if len(splits) < 2:
        return []
    parts = [
        f"{r['name']}: " + ", ".join(f"{d:.4f}" for d in r["shard_divergence"])
        for r in splits.values()
    ]
    return [
        "Byte-frequency divergence of each worker's shard from all the training text (KL, nats; "
        "`benchmarks/quality/splits.py`): " + "; ".join(parts) + ".",
        "",
    ]
