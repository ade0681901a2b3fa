"""``allreduce.streamed.bucket_plan``: a sharded group's rank 0 cuts the quorum's buckets
exactly as a plain member's ``collective._packed`` does, or the two would run different
collectives in one quorum."""

from __future__ import annotations

import random

import torch

from diloco.worker.allreduce.collective import _packed, table_of
from diloco.worker.allreduce.streamed import bucket_plan, table


def _packed_pieces(numels: list[int], capacity: int) -> list[list[tuple[int, int, int, int]]]:
    """``_packed``'s buckets, read back as (tensor, start, elements, start in bucket)."""
    flats = [torch.empty(n) for n in numels]
    out = []
    for bucket, pieces in _packed(flats, torch.float32, capacity * 4, torch.device("cpu")):
        row = []
        for own, part in pieces:
            i = next(
                j
                for j, f in enumerate(flats)
                if f.numel()
                and own.data_ptr() >= f.data_ptr()
                and own.data_ptr() < f.data_ptr() + f.numel() * 4
            )
            start = (own.data_ptr() - flats[i].data_ptr()) // 4
            at = (part.data_ptr() - bucket.data_ptr()) // 4
            row.append((i, start, own.numel(), at))
        out.append(row)
    return out


def test_bucket_plan_is_packed_s_cut() -> None:
    rng = random.Random(7)
    cases = [([5, 0, 3, 12, 1], 4), ([10], 10), ([10], 3), ([0, 0], 2), ([2, 2, 2], 100)]
    for _ in range(30):
        cases.append(
            ([rng.choice([0, 1, 7, 30]) for _ in range(rng.randint(1, 6))], rng.randint(1, 16))
        )
    for numels, capacity in cases:
        assert list(bucket_plan(numels, capacity)) == _packed_pieces(numels, capacity), (
            numels,
            capacity,
        )


def test_table_is_table_of_the_fp32_tensors() -> None:
    shapes = [(16, 6), (16,), (0,), ()]
    entries = [("snap", f"p{i}", s) for i, s in enumerate(shapes)]
    assert table(entries) == table_of([torch.empty(s) for s in shapes])
