"""The demo's data and model: deterministic, non-iid shards, held-out text kept apart."""

from __future__ import annotations

import math

import pytest
import torch

from diloco.demo.data import (
    VOCAB_SIZE,
    build_corpus,
    decode,
    drop_repeated_paragraphs,
    encode,
    load_topics,
    sample_batch,
    split_topic,
)
from diloco.demo.model import build_model, eval_windows, evaluate, loss_on


def test_encoding_is_fixed_bytes_and_round_trips() -> None:
    text = "def f(x):\n    return x  # naïve ’quotes’"
    tokens = encode(text)
    assert tokens.dtype == torch.int64
    assert tokens.tolist() == list(text.encode("utf-8"))  # the same ids in every process
    assert 0 <= int(tokens.min()) and int(tokens.max()) < VOCAB_SIZE
    assert decode(tokens) == text


def test_topics_are_sorted_and_complete() -> None:
    topics = load_topics()
    names = [n for n, _ in topics]
    assert names == sorted(names) and len(set(names)) == len(names) > 20


def test_corpus_is_deterministic() -> None:
    a, b = build_corpus(3), build_corpus(3)
    assert a.shard_topics == b.shard_topics
    assert all(x.equal(y) for x, y in zip(a.shards, b.shards, strict=True))
    assert a.eval.equal(b.eval) and a.train.equal(b.train)


@pytest.mark.parametrize("num_shards", [1, 2, 4, 5])
def test_shards_are_disjoint_topics_covering_the_training_text(num_shards: int) -> None:
    corpus = build_corpus(num_shards)
    assert len(corpus.shards) == len(corpus.shard_topics) == num_shards
    assert all(len(s) > 0 for s in corpus.shards)
    flat = [t for names in corpus.shard_topics for t in names]
    assert sorted(flat) == [n for n, _ in load_topics()]  # every topic in exactly one shard
    assert sum(len(s) for s in corpus.shards) == len(corpus.train)
    sizes = [len(s) for s in corpus.shards]
    assert max(sizes) / min(sizes) < 1.05
    # Each shard is exactly the training parts of its own topics.
    texts = dict(load_topics())
    for shard, names in zip(corpus.shards, corpus.shard_topics, strict=True):
        expected = [split_topic(encode(texts[n]), 0.1)[0] for n in names]
        assert shard.equal(torch.cat(expected))


def test_eval_text_is_the_tail_of_every_topic_and_in_no_shard() -> None:
    corpus = build_corpus(4)
    topics = load_topics()
    tails = [split_topic(encode(text), 0.1)[1] for _, text in topics]
    assert corpus.eval.equal(torch.cat(tails))
    assert all(len(t) > 0 for t in tails)  # every topic is represented
    # Topics quote one another; after dropping repeated paragraphs, almost no 64-byte piece of
    # held-out text occurs in any shard (a few boilerplate phrases do).
    shard_bytes = [bytes(s.to(torch.uint8).tolist()) for s in corpus.shards]
    pieces = [bytes(t[i : i + 64].tolist()) for t in tails for i in range(0, len(t) - 63, 16)]
    leaked = sum(any(p in s for s in shard_bytes) for p in pieces)
    assert len(pieces) > 1000 and leaked / len(pieces) < 0.01


def test_repeated_paragraphs_are_kept_once() -> None:
    topics = [("a", "one\n\ntwo"), ("b", "two\n\nthree\n\n  one  "), ("c", "three")]
    assert drop_repeated_paragraphs(topics) == [("a", "one\n\ntwo"), ("b", "three")]


def test_batches_are_windows_with_next_token_targets_and_seeded() -> None:
    tokens = torch.arange(1000)
    x, y = sample_batch(tokens, 8, 16, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (8, 16) and x.dtype == y.dtype == torch.int64
    assert torch.equal(y, x + 1)
    assert torch.equal(x[:, 1:] - x[:, :1], torch.arange(1, 16).expand(8, -1))  # contiguous
    x2, _ = sample_batch(tokens, 8, 16, torch.Generator().manual_seed(0))
    assert torch.equal(x, x2)
    # Every window fits, including the last one.
    xs, ys = sample_batch(torch.arange(17), 32, 16, torch.Generator().manual_seed(1))
    assert torch.equal(xs[0], torch.arange(16)) and torch.equal(ys[0], torch.arange(1, 17))
    with pytest.raises(ValueError):
        sample_batch(torch.arange(16), 1, 16, torch.Generator())


def test_model_is_deterministic_and_leaves_the_global_rng_alone() -> None:
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a, b, c = build_model(3), build_model(3), build_model(4)
    assert torch.equal(torch.rand(1), before)
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert na == nb and torch.equal(pa, pb)
    assert not torch.equal(a.embed.weight, c.embed.weight)


def test_fresh_model_loss_is_near_uniform_and_evaluation_is_fixed() -> None:
    corpus = build_corpus(2)
    model = build_model(0)
    loss = evaluate(model, corpus.eval, windows=32)
    assert abs(loss - math.log(VOCAB_SIZE)) < 0.5
    assert evaluate(model, corpus.eval, windows=32) == loss
    starts = eval_windows(corpus.eval, 64, 32)
    assert int(starts[0]) == 0 and int(starts[-1]) == len(corpus.eval) - 65


def test_model_is_causal_and_trains() -> None:
    model = build_model(0)
    x = torch.randint(0, VOCAB_SIZE, (2, 32), generator=torch.Generator().manual_seed(0))
    changed = x.clone()
    changed[:, 20:] = (changed[:, 20:] + 1) % VOCAB_SIZE
    with torch.no_grad():
        assert torch.allclose(model(x)[:, :20], model(changed)[:, :20], atol=1e-5)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    y = torch.roll(x, -1, dims=1)
    first = loss_on(model, x, y).item()
    for _ in range(5):
        loss = loss_on(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert loss_on(model, x, y).item() < first
