"""The demo's character model laid out as an ``nn.Sequential`` (``diloco.demo.sequential``):
the same function as ``CharTransformer``, bit for bit, on the same parameters, and cut into
pipeline stages whose head takes token ids."""

from __future__ import annotations

import pytest
import torch

from diloco.demo.data import VOCAB_SIZE
from diloco.demo.model import build_model, loss_on
from diloco.demo.sequential import as_sequential, build_sequential
from diloco.swarm import split_sequential


def _tokens(batch: int = 3, time: int = 64, seed: int = 5) -> torch.Tensor:
    return torch.randint(
        0, VOCAB_SIZE, (batch, time), generator=torch.Generator().manual_seed(seed)
    )


def test_the_sequence_computes_the_demo_models_logits_and_gradients_bit_for_bit() -> None:
    model = build_model(0)
    seq = as_sequential(model)
    x, y = _tokens(), _tokens(seed=6)
    assert torch.equal(seq(x), model(x))
    assert torch.equal(seq(x[:, :17]), model(x[:, :17]))  # shorter than the context: mask cut
    with torch.no_grad():
        seq.eval(), model.eval()
        assert torch.equal(seq(x), model(x))
    seq.train(), model.train()
    loss_on(model, x, y).backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}  # type: ignore[union-attr]
    model.zero_grad()
    loss_on(seq, x, y).backward()
    got = {id(p): p.grad for p in seq.parameters()}
    for n, p in model.named_parameters():
        assert torch.equal(got[id(p)], want[n]), n  # type: ignore[arg-type]


def test_the_sequence_shares_the_models_parameters_and_the_demo_model_is_unchanged() -> None:
    model = build_model(0)
    seq = as_sequential(model)
    assert {id(p) for p in seq.parameters()} == {id(p) for p in model.parameters()}
    assert [n for n, _ in build_model(0).named_parameters()][:2] == ["pos", "embed.weight"]
    built = build_sequential(0)
    assert all(torch.equal(a, b) for a, b in zip(built.parameters(), seq.parameters(), strict=True))


def test_three_stages_keep_the_unsplit_names_and_chained_give_the_same_logits() -> None:
    seq = build_sequential(0)
    stages = split_sequential(seq, 3)
    names = [n for s in stages for n, _ in s.named_parameters()]
    assert names == [n for n, _ in seq.named_parameters()]
    assert [n for n, _ in stages[0].named_parameters()] == ["0.pos", "0.embed.weight"]
    x = _tokens()
    h = x  # the head stage takes the token ids
    for s in stages:
        h = s(h)
    assert torch.equal(h, seq(x))


def test_a_sequence_longer_than_the_context_is_refused() -> None:
    with pytest.raises(ValueError, match="longer than the context"):
        build_sequential(0, context=8)(_tokens(time=9))
