"""The demo's character model as an ``nn.Sequential``: embedding, one layer per block, head.

A pipeline swarm cuts a sequence of layers into stages (``diloco.swarm.split_sequential``);
``CharTransformer`` is one module whose ``forward`` wires its parts, so it cannot be cut. This
module lays the same parts out in a row, sharing (not copying) the parameters of a
``CharTransformer``: the sequence computes the same function, bit for bit, and training it
trains that model. The demo itself keeps building and training ``CharTransformer`` unchanged.

The first layer takes the int64 token ids ``(batch, time)``; every layer after it maps
activations ``(batch, time, d_model)`` to the same shape, and the last one gives the logits
``(batch, time, VOCAB_SIZE)``. So every boundary of a split carries ``(time, d_model)`` per
sample.
"""

from __future__ import annotations

import torch
from torch import nn

from diloco.demo.model import CharTransformer, build_model


class Embed(nn.Module):
    """Token embedding plus learned positions: ``(batch, time)`` ids to activations."""

    def __init__(self, model: CharTransformer) -> None:
        super().__init__()
        self.embed, self.pos, self.context = model.embed, model.pos, model.context

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        if t > self.context:
            raise ValueError(f"sequence of {t} tokens is longer than the context ({self.context})")
        return self.embed(x) + self.pos[:t]


class Block(nn.Module):
    """One pre-norm encoder block under the causal mask (the model's mask, a buffer that is
    not saved: every stage rebuilds it)."""

    def __init__(self, layer: nn.Module, context: int) -> None:
        super().__init__()
        self.layer = layer
        self.mask: torch.Tensor
        self.register_buffer(
            "mask", nn.Transformer.generate_square_subsequent_mask(context), persistent=False
        )

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        t = h.shape[1]
        return self.layer(h, src_mask=self.mask[:t, :t], is_causal=True)


class Head(nn.Module):
    """The final norm and the untied output head: activations to logits."""

    def __init__(self, model: CharTransformer) -> None:
        super().__init__()
        self.norm, self.head = model.norm, model.head

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(h))


def as_sequential(model: CharTransformer) -> nn.Sequential:
    """``model`` as ``Sequential(Embed, Block x layers, Head)``, sharing its parameters."""
    blocks = [Block(layer, model.context) for layer in model.blocks.layers]
    return nn.Sequential(Embed(model), *blocks, Head(model))


def build_sequential(seed: int = 0, context: int = 64) -> nn.Sequential:
    """The demo model of ``build_model(seed, context)``, laid out as a sequence: the same
    initial parameters in every process."""
    return as_sequential(build_model(seed, context))
