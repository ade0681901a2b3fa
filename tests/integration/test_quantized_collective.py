"""The quantized all-reduce (``worker/allreduce/quantized.py`` through ``checked_average``) on
real gloo groups: 2 and 3 members in threads, int8, int4 and topk, over a rendezvous served on
loopback. Every rank ends with the same bits, the average is within the quantizers' bound of the
fp32 one, the residuals repay what was dropped (two rounds), only a committed round moves them,
and the bytes are what the slots say."""

from __future__ import annotations

import math

import pytest
import torch

from diloco.core.codecs import BlockCodec, Int4Codec, Int8Codec, TopKCodec
from diloco.core.codecs.shard_reduce import relative_error, shard_bounds, slot_bytes
from diloco.worker.allreduce.average_checks import Averaged, checked_average
from diloco.worker.allreduce.collective import QuorumCollective, table_of
from diloco.worker.allreduce.quantized import Quantized, Residuals
from tests.helpers.rendezvous_host import RendezvousHost
from tests.helpers.threads import in_threads

SHAPES = [(300,), (37, 11), (5000,)]  # odd sizes: blocks and shards across tensor ends
BUCKET = 16 << 10  # 4096 fp32 elements: several buckets, so the bucketing is exercised
WEIGHTS = [1.0, 3.0, 2.0]


def contribution(rank: int, round_: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * round_ + rank)
    return [torch.randn(s, generator=gen) * (rank + 1) for s in SHAPES]


def rounds(
    size: int, make: type[BlockCodec], n_rounds: int
) -> list[tuple[list[list[torch.Tensor]], list[Averaged], Residuals]]:
    """Each member's averages by round, its ``Averaged`` by round, and its residuals."""
    with RendezvousHost(timeout=10.0) as host:

        def member(rank: int) -> tuple[list[list[torch.Tensor]], list[Averaged], Residuals]:
            residuals, outs, infos = Residuals(), [], []
            for r in range(n_rounds):
                qid = f"quant-{size}-{make.name}-{r}"
                tensors = contribution(rank, r)
                flats = [t.view(-1) for t in tensors]
                quantized = Quantized(make(), residuals.of("k", flats), residuals.begin("k", flats))
                with QuorumCollective.build(host.meeting(rank), qid, rank, size, 10.0) as q:
                    got = checked_average(
                        q, tensors, WEIGHTS[rank], norm_bound=1e9, bucket_bytes=BUCKET,
                        quantized=quantized,
                    )  # fmt: skip
                residuals.commit()
                outs.append(tensors)
                infos.append(got)
            return outs, infos, residuals

        return in_threads(size, member, timeout=120)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("make", [Int8Codec, Int4Codec, TopKCodec], ids=["int8", "int4", "topk"])
def test_every_rank_gets_the_same_bits_within_the_bound_and_the_residuals_repay(
    size: int, make: type[BlockCodec]
) -> None:
    results = rounds(size, make, 2)
    codec = make()
    total = sum(WEIGHTS[:size])
    for r in range(2):
        first = results[0][0][r]
        for outs, _, _ in results[1:]:
            for a, b in zip(outs[r], first, strict=True):
                assert torch.equal(a, b), (size, r)  # bit-identical on every rank
        assert all(infos[r].sound for _, infos, _ in results)
    # Round 1 (no residuals yet): within the two quantizations' bound of the fp32 average.
    exact = [
        sum(WEIGHTS[i] / total * contribution(i, 0)[k] for i in range(size))
        for k in range(len(SHAPES))
    ]
    pairs = zip(results[0][0][0], exact, strict=True)
    error = math.sqrt(sum(float((a - e).norm()) ** 2 for a, e in pairs))
    stated = sum(WEIGHTS[i] / total * norm_of(contribution(i, 0)) for i in range(size))
    q = relative_error(codec)
    if codec.sparse:
        # Each member's decoded parts are within (1 + q) of its kept elements' norm; what was
        # not kept (most of it) is owed, not lost (below).
        assert 0 < error <= (2 + q) * stated
    else:
        assert 0 < error <= q * (2 + q) * stated
    # Two rounds: what was applied plus every member's residual is the exact sum of the fp32
    # averages (fp32 rounding of the sums only).
    both = [
        sum(
            WEIGHTS[i] / total * (contribution(i, 0)[k] + contribution(i, 1)[k])
            for i in range(size)
        )
        for k in range(len(SHAPES))
    ]
    for k in range(len(SHAPES)):
        applied = results[0][0][0][k] + results[0][0][1][k]
        owed = sum(res.held["k"][k].view(SHAPES[k]) for _, _, res in results)
        torch.testing.assert_close(applied + owed, both[k], rtol=0, atol=2e-5)
    # Bytes: per bucket, (N - 1) slots out and in, in each of the all-to-all and the all-gather
    # (topk: in its one all-gather, each slot the whole bucket's sparse parts).
    numel = sum(math.prod(s) for s in SHAPES)
    expected = 0
    for start in range(0, numel, BUCKET // 4):
        n = min(BUCKET // 4, numel - start)
        if codec.sparse:
            expected += (size - 1) * slot_bytes(codec, n)
            continue
        step = max(hi - lo for lo, hi in shard_bounds(n, size, codec.align))
        expected += 2 * (size - 1) * slot_bytes(codec, step)
    for _, infos, _ in results:
        moved = infos[0].moved
        assert moved is not None and moved.sent == moved.received == expected


def norm_of(tensors: list[torch.Tensor]) -> float:
    return math.sqrt(sum(float(t.norm()) ** 2 for t in tensors))


def hand_contribution(rank: int) -> list[torch.Tensor]:
    """One 128-element tensor (two int8 blocks, one shard each): member 0 fills block 0, member
    1 block 1, each with an absmax of 254 so that, at weight 1/2, the block's scale is exactly 1
    and its codes are its values rounded half to even."""
    t = torch.zeros(128)
    t[64 * rank : 64 * rank + 3] = torch.tensor(
        [254.0, 0.5, 1.5] if rank == 0 else [254.0, 1.5, 0.5]
    )
    return [t]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("decay", "second", "owed"),
    [
        # c = x/2 + e: round 1 [127, .25, .75] -> codes [127, 0, 1], e [0, .25, -.25]; round 2
        # plain [127, .5, .5] -> [127, 0, 0], e [0, .5, .5]; decayed by 1/2 [127, .375, .625]
        # -> [127, 0, 1], e [0, .375, -.375]. Member 1 the same with its two values swapped.
        (1.0, [127.0, 0.0, 0.0], [0.0, 0.5, 0.5]),
        (0.5, [127.0, 0.0, 1.0], [0.0, 0.375, -0.375]),
    ],
)
def test_the_worker_decay_scales_the_quorum_residual_by_hand(
    decay: float, second: list[float], owed: list[float]
) -> None:
    """Two members, two int8 rounds with the same pseudo-gradients through ``Residuals`` with a
    decay (the worker's ``ef_decay``, or its outer rule's): each member sends ``x / 2 + decay *
    e``; the averages and the residuals are the hand-computed ones above (the requantized sums
    are exact: scale 1)."""
    with RendezvousHost(timeout=10.0) as host:

        def member(rank: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
            residuals, averages = Residuals(), []
            for r in range(2):
                tensors = hand_contribution(rank)
                quantized = residuals.for_round("int8", 0, tensors, decay)
                assert quantized is not None and quantized.decay == decay
                with QuorumCollective.build(host.meeting(rank), f"decay-{r}", rank, 2, 10.0) as q:
                    got = checked_average(q, tensors, 1.0, norm_bound=1e9, quantized=quantized)
                assert got.sound
                residuals.commit()
                averages.append(tensors[0].clone())
            return averages, residuals.of(f"0;{table_of([torch.zeros(128)])}", [torch.zeros(128)])

        results = in_threads(2, member, timeout=60)
    first = torch.zeros(128)
    first[:3], first[64:67] = torch.tensor([127.0, 0.0, 1.0]), torch.tensor([127.0, 1.0, 0.0])
    then = torch.zeros(128)
    then[:3], then[64:67] = torch.tensor(second), torch.tensor([second[0], *second[:0:-1]])
    for rank, (averages, (residual,)) in enumerate(results):
        assert torch.equal(averages[0], first) and torch.equal(averages[1], then), rank
        want = torch.zeros(128)
        mine = owed if rank == 0 else [owed[0], *owed[:0:-1]]
        want[64 * rank : 64 * rank + 3] = torch.tensor(mine)
        assert torch.equal(residual, want), rank


def test_residuals_move_only_at_commit_and_go_when_forgotten() -> None:
    flats = [torch.ones(4)]
    res = Residuals()
    held = res.of("k", flats)
    res.begin("k", flats)[0].fill_(0.5)
    assert torch.equal(res.of("k", flats)[0], torch.zeros(4))  # a discarded round: unchanged
    res.commit()
    assert torch.equal(res.of("k", flats)[0], torch.full((4,), 0.5))
    assert res.of("k", flats)[0] is not held  # the old buffer is reused as the next pending
    res.begin("k", flats)[0].fill_(2.0)  # a round that failed before its commit point...
    res.discard()  # ...then a round that fills nothing (a dense quorum) and steps
    res.commit()
    assert torch.equal(res.of("k", flats)[0], torch.full((4,), 0.5))
    res.forget()
    assert res.held == {} and res.norm("k") == 0.0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("make", [Int8Codec, TopKCodec], ids=["int8", "topk"])
def test_the_checks_leave_a_nan_member_out_of_a_quantized_average(
    make: type[BlockCodec],
) -> None:
    """Member 1's pseudo-gradient holds a NaN: every member's verdict leaves it out, it sends
    zeros and keeps its residual unsent and undecayed (the decay, 1/2 here, scales only a residual
    sent: its new one is the old one, plus the requantization's share of the shard it reduced:
    none for topk), and the others' average is finite and the
    same bits on every rank."""
    with RendezvousHost(timeout=10.0) as host:

        def member(rank: int) -> tuple[list[torch.Tensor], Averaged, list[torch.Tensor]]:
            tensors = contribution(rank, 0)
            if rank == 1:
                tensors[0][7] = float("nan")
            flats = [t.view(-1) for t in tensors]
            residuals = Residuals()
            for e in residuals.of("k", flats):
                e.fill_(0.25)  # owed from an earlier round
            pending = residuals.begin("k", flats)
            quantized = Quantized(make(), residuals.of("k", flats), pending, decay=0.5)
            with QuorumCollective.build(host.meeting(rank), f"nan-{make.name}", rank, 3, 10.0) as q:
                got = checked_average(
                    q, tensors, 1.0, norm_bound=1e9, bucket_bytes=BUCKET, quantized=quantized
                )
            return tensors, got, pending

        results = in_threads(3, member, timeout=60)
    for tensors, got, _ in results:
        assert got.verdict.excluded == (1,) and got.sound
        assert all(bool(torch.isfinite(t).all()) for t in tensors)
        for a, b in zip(tensors, results[0][0], strict=True):
            assert torch.equal(a, b)
    left_out = torch.cat(results[1][2])
    if make is TopKCodec:
        assert torch.equal(left_out, torch.full_like(left_out, 0.25))
    else:
        assert bool(torch.isfinite(left_out).all())
        assert float((left_out - 0.25).abs().max()) < 0.1  # only its shard's requantization
