"""How non-iid a split is (benchmarks/quality/splits.py): the divergence against a hand-computed
value, and the skewed split of claim l against the iid and by-package splits of the CPU profile's
stdlib corpus."""

from __future__ import annotations

import math

import pytest
import torch
from benchmarks.quality.protocol import CPU
from benchmarks.quality.splits import divergence, shard_divergences, skewed_corpus


def test_divergence_matches_a_hand_computed_kl() -> None:
    """Bytes {0: 3, 1: 1} against {0: 1, 1: 1}: with a half added to each of the 256 counts,
    p = (3.5, 1.5, 0.5 ...)/132 and q = (1.5, 1.5, 0.5 ...)/130."""
    a, b = torch.tensor([0, 0, 0, 1]), torch.tensor([0, 1])
    p = [3.5 / 132, 1.5 / 132] + [0.5 / 132] * 254
    q = [1.5 / 130, 1.5 / 130] + [0.5 / 130] * 254
    expected = sum(pi * math.log(pi / qi) for pi, qi in zip(p, q, strict=True))
    assert divergence(a, b) == pytest.approx(expected, rel=1e-12)
    assert divergence(b, b) == 0.0


def test_skewed_split_is_clearly_non_iid_and_keeps_the_text() -> None:
    """On the CPU profile's corpus with 4 workers, every shard of the skewed split diverges from the
    training text at least 5 times as much as the most divergent iid shard, and on average 4
    times as much as the by-package split's shards; the shards hold the same training bytes (as a
    multiset), in near-equal sizes, and the held-out text is the same."""
    topic, iid = CPU.corpus(4, "non-iid"), CPU.corpus(4, "iid")
    skewed = CPU.corpus(4, "skewed")
    d_skewed, d_iid, d_topic = (shard_divergences(c) for c in (skewed, iid, topic))
    assert min(d_skewed) >= 5 * max(d_iid), (d_skewed, d_iid)
    assert sum(d_skewed) >= 4 * sum(d_topic), (d_skewed, d_topic)
    counts = torch.bincount(torch.cat(skewed.shards), minlength=256)
    assert torch.equal(counts, torch.bincount(topic.train, minlength=256))
    sizes = [len(s) for s in skewed.shards]
    assert max(sizes) - min(sizes) <= 4096, sizes
    assert torch.equal(skewed.eval, topic.eval)


def test_skewed_split_is_deterministic_and_refuses_too_few_pieces() -> None:
    base = CPU.corpus(1, "non-iid")
    a, b = skewed_corpus(base, 3), skewed_corpus(base, 3)
    assert all(torch.equal(x, y) for x, y in zip(a.shards, b.shards, strict=True))
    with pytest.raises(ValueError, match="cannot fill"):
        skewed_corpus(base, 4, chunk=len(base.train))
    with pytest.raises(ValueError, match="workers must be >= 1"):
        skewed_corpus(base, 0)
