"""Character data from ``pydoc_data.topics`` (English help texts inside CPython: no download).

Text is encoded as UTF-8 bytes, so the vocabulary is fixed (256 symbols) and identical in every
process. Shards follow topics, which makes the split non-iid as in the DiLoCo paper's setting.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

VOCAB_SIZE = 256


def load_topics() -> list[tuple[str, str]]:
    from pydoc_data.topics import topics

    return sorted(topics.items())


def encode(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).to(torch.int64)


def decode(tokens: torch.Tensor) -> str:
    return bytes(tokens.to(torch.uint8).tolist()).decode("utf-8", errors="replace")


@dataclass(frozen=True)
class Corpus:
    shards: list[torch.Tensor]  # training tokens of each worker
    train: torch.Tensor  # all training tokens (the single-worker baseline)
    eval: torch.Tensor  # held out: the last part of every topic


def build_corpus(num_shards: int, eval_fraction: float = 0.1) -> Corpus:
    """Hold out the tail of every topic for evaluation; deal the rest of each topic to the
    shard with the fewest tokens so far, largest topics first (balanced and deterministic)."""
    if num_shards < 1:
        raise ValueError("num_shards must be >= 1")
    if not 0 < eval_fraction < 1:
        raise ValueError("eval_fraction must be in (0, 1)")
    train_parts: list[torch.Tensor] = []
    eval_parts: list[torch.Tensor] = []
    for _name, text in load_topics():
        tokens = encode(text)
        cut = int(len(tokens) * (1 - eval_fraction))
        train_parts.append(tokens[:cut])
        eval_parts.append(tokens[cut:])
    buckets: list[list[torch.Tensor]] = [[] for _ in range(num_shards)]
    sizes = [0] * num_shards
    for part in sorted(train_parts, key=lambda t: -len(t)):
        i = sizes.index(min(sizes))
        buckets[i].append(part)
        sizes[i] += len(part)
    shards = [torch.cat(b) for b in buckets]
    return Corpus(shards, torch.cat(train_parts), torch.cat(eval_parts))


def sample_batch(
    tokens: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows: inputs and next-character targets."""
    starts = torch.randint(0, len(tokens) - seq_len - 1, (batch_size,), generator=generator)
    idx = starts[:, None] + torch.arange(seq_len + 1)[None, :]
    windows = tokens[idx]
    return windows[:, :-1], windows[:, 1:]
