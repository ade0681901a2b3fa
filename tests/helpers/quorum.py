"""The tensors each member of a quorum averages, the same in the test and in the member
processes (tests/programs/quorum_member.py), so that the test can compute the mean itself."""

from __future__ import annotations

import torch


def member_tensors(seed: int, rank: int, shapes: list[list[int]]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    return [torch.randn(shape, generator=gen) for shape in shapes]


def mixed_tensors(seed: int, rank: int) -> list[torch.Tensor]:
    """fp32, int64 and bf16 tensors: a broadcast must move every dtype bit for bit."""
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    return [
        torch.randn(1000, 3, generator=gen),
        torch.randint(-(2**40), 2**40, (17,), generator=gen),
        torch.randn(50_001, generator=gen).to(torch.bfloat16),
    ]
