"""The demo's data and model: deterministic, non-iid shards, held-out text kept apart."""

from __future__ import annotations

import math

import torch

from diloco.demo.data import VOCAB_SIZE, build_corpus, decode, encode, sample_batch
from diloco.demo.model import build_model, evaluate


def test_encoding_round_trips_and_is_fixed() -> None:
    text = "def f(x):\n    return x  # naïve"
    tokens = encode(text)
    assert decode(tokens) == text
    assert int(tokens.max()) < VOCAB_SIZE and tokens.dtype == torch.int64


def test_shards_are_balanced_disjoint_topics_and_eval_is_held_out() -> None:
    corpus = build_corpus(4)
    sizes = [len(s) for s in corpus.shards]
    assert min(sizes) > 0 and max(sizes) / min(sizes) < 1.2
    assert sum(sizes) == len(corpus.train)
    # A held-out window appears in no shard (checked on a few distinctive 64-byte windows).
    for start in (0, len(corpus.eval) // 2, len(corpus.eval) - 70):
        needle = decode(corpus.eval[start : start + 64])
        assert all(needle not in decode(s) for s in corpus.shards)
    assert build_corpus(4).shards[2].equal(corpus.shards[2])  # deterministic


def test_batches_are_next_character_targets() -> None:
    tokens = torch.arange(1000)
    x, y = sample_batch(tokens, 8, 16, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (8, 16)
    assert torch.equal(y, x + 1)


def test_model_is_deterministic_and_starts_near_uniform() -> None:
    a, b = build_model(3), build_model(3)
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert na == nb and torch.equal(pa, pb)
    loss = evaluate(a, build_corpus(2).eval, windows=8)
    assert abs(loss - math.log(VOCAB_SIZE)) < 0.5
