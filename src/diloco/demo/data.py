"""Character data from ``pydoc_data.topics``: English help texts that ship inside CPython.

Nothing is downloaded. Text is encoded as UTF-8 bytes, so the vocabulary is the 256 byte values:
fixed, with no unknown symbol, and identical in every process. Paragraphs that several topics
share are kept once. The training text is split into shards by topic (a worker sees only its own
topics: a non-iid split, as in the DiLoCo paper), and the tail of every topic is held out, so the
evaluation text covers all topics and appears in no shard.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

VOCAB_SIZE = 256
"""Tokens are the byte values of the UTF-8 encoding."""


def load_topics() -> list[tuple[str, str]]:
    """All ``(topic name, text)`` pairs, sorted by name so the order is the same everywhere,
    with repeated paragraphs removed (see :func:`drop_repeated_paragraphs`)."""
    from pydoc_data.topics import topics

    return drop_repeated_paragraphs(sorted(topics.items()))


def drop_repeated_paragraphs(topics: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Keep only the first occurrence of each paragraph (text between blank lines) across all
    topics, in the given order; topics left empty are dropped.

    The help topics quote one another at length ("specialnames" contains all of "customization",
    for example): without this, about a third of the held-out text would also be training text of
    another topic, and the held-out loss would partly measure memorisation."""
    seen: set[str] = set()
    out: list[tuple[str, str]] = []
    for name, text in topics:
        kept = []
        for paragraph in text.split("\n\n"):
            key = paragraph.strip()
            if not key or key in seen:
                continue
            seen.add(key)
            kept.append(paragraph)
        if kept:
            out.append((name, "\n\n".join(kept)))
    return out


def encode(text: str) -> torch.Tensor:
    """UTF-8 bytes of ``text`` as an int64 tensor of token ids in ``[0, VOCAB_SIZE)``."""
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.int64)


def decode(tokens: torch.Tensor) -> str:
    """The inverse of :func:`encode` (a byte sequence cut inside a character decodes to U+FFFD)."""
    return bytes(tokens.to(torch.uint8).tolist()).decode("utf-8", errors="replace")


@dataclass(frozen=True)
class Corpus:
    """Token tensors for one run with ``len(shards)`` workers."""

    shards: list[torch.Tensor]
    """Training tokens of each worker: whole topics, disjoint."""

    train: torch.Tensor
    """All training tokens (what the single-process baseline trains on)."""

    eval: torch.Tensor
    """Held-out tokens: the tail of every topic."""

    shard_topics: list[list[str]] = field(default_factory=list)
    """The topic names in each shard, in shard order."""


def split_topic(tokens: torch.Tensor, eval_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(train, eval)``: the first ``1 - eval_fraction`` of a topic and the rest."""
    cut = int(len(tokens) * (1 - eval_fraction))
    return tokens[:cut], tokens[cut:]


def build_corpus(num_shards: int, eval_fraction: float = 0.1) -> Corpus:
    """Hold out the tail of every topic, then deal the topics' training parts to ``num_shards``
    shards: largest topic first, each to the shard with the fewest tokens so far (ties go to the
    lowest index). Deterministic; within 1% of equal sizes for up to 8 shards (the largest topic is
    11% of the text, so more shards get less even)."""
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    if not 0 < eval_fraction < 1:
        raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
    topics = load_topics()
    if num_shards > len(topics):
        raise ValueError(f"at most {len(topics)} shards (one topic each), got {num_shards}")
    names: list[str] = []
    train_parts: list[torch.Tensor] = []
    eval_parts: list[torch.Tensor] = []
    for name, text in topics:
        train, held_out = split_topic(encode(text), eval_fraction)
        names.append(name)
        train_parts.append(train)
        eval_parts.append(held_out)
    members: list[list[int]] = [[] for _ in range(num_shards)]
    sizes = [0] * num_shards
    # Python's sort is stable: equal lengths keep name order.
    for i in sorted(range(len(topics)), key=lambda i: -len(train_parts[i])):
        smallest = sizes.index(min(sizes))
        members[smallest].append(i)
        sizes[smallest] += len(train_parts[i])
    return Corpus(
        shards=[torch.cat([train_parts[i] for i in m]) for m in members],
        train=torch.cat(train_parts),
        eval=torch.cat(eval_parts),
        shard_topics=[[names[i] for i in m] for m in members],
    )


def sample_batch(
    tokens: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch_size`` random windows of ``tokens``: inputs ``x`` and next-token targets ``y``,
    both int64 of shape ``(batch_size, seq_len)``. The same generator state gives the same batch."""
    if len(tokens) < seq_len + 1:
        raise ValueError(f"need at least {seq_len + 1} tokens, got {len(tokens)}")
    starts = torch.randint(0, len(tokens) - seq_len, (batch_size,), generator=generator)
    windows = tokens[starts[:, None] + torch.arange(seq_len + 1)]
    return windows[:, :-1], windows[:, 1:]
