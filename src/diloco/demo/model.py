"""A small causal transformer over bytes, built from plain torch.nn."""

from __future__ import annotations

import torch
from torch import nn

from diloco.demo.data import VOCAB_SIZE


class CharTransformer(nn.Module):
    def __init__(
        self, d_model: int = 96, layers: int = 2, heads: int = 4, context: int = 64
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
        t = x.shape[1]
        h = self.embed(x) + self.pos[:t]
        h = self.blocks(h, mask=self.mask[:t, :t], is_causal=True)
        return self.head(self.norm(h))


def build_model(seed: int = 0, context: int = 64) -> CharTransformer:
    """Same seed, same initial parameters in every process."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return CharTransformer(context=context)


def loss_on(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


@torch.no_grad()
def evaluate(model: nn.Module, tokens: torch.Tensor, seq_len: int = 64, windows: int = 64) -> float:
    """Mean cross-entropy (nats per byte) over fixed, evenly spaced windows of ``tokens``."""
    was_training = model.training
    model.eval()
    starts = torch.linspace(0, len(tokens) - seq_len - 2, windows).long()
    idx = starts[:, None] + torch.arange(seq_len + 1)[None, :]
    w = tokens[idx]
    loss = float(loss_on(model, w[:, :-1], w[:, 1:]))
    model.train(was_training)
    return loss
