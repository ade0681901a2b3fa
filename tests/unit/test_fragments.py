"""Fragments balanced by size and a schedule that sends each exactly once per period."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from diloco.core.fragments import Span, fragment_due, split_sequential, split_strided, sync_offsets

# A GPT-2-small-like table: two huge tensors (embedding, output) and twelve blocks.
GPT_LIKE = [("wte", 50257 * 768), ("wpe", 1024 * 768)]
for layer in range(12):
    GPT_LIKE += [
        (f"h.{layer}.attn", 4 * 768 * 768),
        (f"h.{layer}.mlp", 8 * 768 * 768),
        (f"h.{layer}.ln", 2 * 768),
    ]
GPT_LIKE += [("lm_head", 50257 * 768)]


def covered(fragments: list[list[Span]]) -> dict[str, list[tuple[int, int]]]:
    out: dict[str, list[tuple[int, int]]] = {}
    for frag in fragments:
        for s in frag:
            out.setdefault(s.name, []).append((s.start, s.stop))
    return {k: sorted(v) for k, v in out.items()}


@pytest.mark.parametrize("split", [split_sequential, split_strided])
@pytest.mark.parametrize("k", [2, 3, 4, 7])
def test_gpt_like_model_splits_within_ten_percent(split, k: int) -> None:
    fragments = split(GPT_LIKE, k)
    sizes = [sum(s.numel for s in f) for f in fragments]
    assert sum(sizes) == sum(n for _, n in GPT_LIKE)
    assert max(sizes) / min(sizes) < 1.10
    # Every element of every parameter is in exactly one fragment.
    for name, n in GPT_LIKE:
        spans = covered(fragments)[name]
        assert spans[0][0] == 0 and spans[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))


def test_sequential_by_hand() -> None:
    # 10 elements in 3 fragments: bounds 0, 3, 6, 10.
    got = split_sequential([("a", 4), ("b", 6)], 3)
    assert got == [[Span("a", 0, 3)], [Span("a", 3, 4), Span("b", 0, 2)], [Span("b", 2, 6)]]


def test_strided_samples_every_depth() -> None:
    sizes = [(f"layer{i}", 100) for i in range(8)]
    frags = split_strided(sizes, 2)
    names = [{s.name for s in f} for f in frags]
    assert "layer0" in names[0] and "layer7" in names[1]
    assert all(len(n) >= 4 for n in names)  # both reach early and late layers


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(sizes=st.lists(st.integers(1, 500), min_size=1, max_size=12), k=st.integers(1, 6))
def test_sequential_is_exactly_balanced(sizes: list[int], k: int) -> None:
    table = [(f"p{i}", n) for i, n in enumerate(sizes)]
    if sum(sizes) < k:
        with pytest.raises(ValueError):
            split_sequential(table, k)
        return
    frag_sizes = [sum(s.numel for s in f) for f in split_sequential(table, k)]
    assert max(frag_sizes) - min(frag_sizes) <= 1


@pytest.mark.parametrize("h,k", [(600, 3), (10, 3), (7, 7), (500, 4), (11, 2)])
def test_every_fragment_once_per_period(h: int, k: int) -> None:
    for period in range(3):
        due = [fragment_due(period * h + s, h, k) for s in range(1, h + 1)]
        sent = [f for f in due if f is not None]
        assert sent == list(range(k))  # each once, in order: fragment 0 never twice
    assert sync_offsets(h, k)[-1] == h  # the last fragment closes the period


def test_schedule_by_hand() -> None:
    assert sync_offsets(600, 3) == [200, 400, 600]
    assert sync_offsets(10, 3) == [3, 6, 10]
    with pytest.raises(ValueError):
        sync_offsets(2, 3)
