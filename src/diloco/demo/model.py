"""A small causal transformer over bytes, built from plain ``torch.nn``.

Defaults (2 layers, width 64, 4 heads, context 64: about 137k parameters) keep one training step
on a 16 x 64 batch near 17 ms on one CPU thread, so several processes can share two cores.
"""

from __future__ import annotations

import torch
from torch import nn

from diloco.demo.data import VOCAB_SIZE


class CharTransformer(nn.Module):
    """Token and learned position embeddings, pre-norm encoder blocks under a causal mask, a
    final norm and an untied output head over the byte vocabulary."""

    def __init__(
        self, d_model: int = 64, layers: int = 2, heads: int = 4, context: int = 64
    ) -> None:
        super().__init__()
        self.context = context
        self.embed = nn.Embedding(VOCAB_SIZE, d_model)
        self.pos = nn.Parameter(torch.zeros(context, d_model))
        block = nn.TransformerEncoderLayer(
            d_model,
            heads,
            dim_feedforward=4 * d_model,
            dropout=0.0,
            batch_first=True,
            norm_first=True,
        )
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, VOCAB_SIZE, bias=False)
        nn.init.normal_(self.pos, std=0.02)
        self.mask: torch.Tensor
        self.register_buffer(
            "mask", nn.Transformer.generate_square_subsequent_mask(context), persistent=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of shape ``(batch, time, VOCAB_SIZE)`` for int64 tokens ``(batch, time)``."""
        t = x.shape[1]
        if t > self.context:
            raise ValueError(f"sequence of {t} tokens is longer than the context ({self.context})")
        h = self.embed(x) + self.pos[:t]
        h = self.blocks(h, mask=self.mask[:t, :t], is_causal=True)
        return self.head(self.norm(h))


def build_model(seed: int = 0, context: int = 64) -> CharTransformer:
    """The demo model, initialised from ``seed`` alone: the same parameters in every process.
    The global random state is left as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return CharTransformer(context=context)


def loss_on(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy (nats) of ``model`` on inputs ``x`` and targets ``y``."""
    logits = model(x)
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def eval_windows(tokens: torch.Tensor, seq_len: int, windows: int) -> torch.Tensor:
    """``windows`` evenly spaced start offsets into ``tokens`` (fixed for a given text)."""
    last = len(tokens) - seq_len - 1
    if last < 0:
        raise ValueError(f"need at least {seq_len + 1} tokens, got {len(tokens)}")
    return torch.linspace(0, last, windows).round().long()


@torch.no_grad()
def evaluate(
    model: nn.Module,
    tokens: torch.Tensor,
    seq_len: int = 64,
    windows: int = 256,
    batch_size: int = 64,
) -> float:
    """Mean cross-entropy (nats per byte) over a fixed set of evenly spaced windows of
    ``tokens``: the same windows on every call, so values are comparable across models.
    256 windows of 64 take about 0.2 s on one thread."""
    was_training = model.training
    model.eval()
    try:
        starts = eval_windows(tokens, seq_len, windows)
        offsets = torch.arange(seq_len + 1)
        total = 0.0
        for chunk in starts.split(batch_size):
            w = tokens[chunk[:, None] + offsets]
            total += float(loss_on(model, w[:, :-1], w[:, 1:])) * len(chunk)
        return total / len(starts)
    finally:
        model.train(was_training)
