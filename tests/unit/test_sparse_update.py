"""The sparse downlink's maths (core/codecs/sparse_update.py), against hand-computed references:
the support is where the round's sum has a bit set and nothing outside it changes under the
plain averaged descent step; the update carries the new values, which a replica copies by index
to the server's exact bits; a malformed update is refused before anything is written; the worker's
buffer refuses bodies that do not fit (worker/state/update_buffer.py)."""

from __future__ import annotations

import pytest
import torch

from diloco.core.codecs import CodecError
from diloco.core.codecs.sparse_update import (
    COUNT,
    INDEX,
    SPAN,
    apply_changes,
    check_update,
    encode_changes,
    metadata,
    pack_positions,
    parts,
    spans,
    unpack_positions,
    update_bytes,
)
from diloco.core.outer import OuterSGD, apply_outer_step
from diloco.wire import (
    CODE_OF_DTYPE,
    Layout,
    TensorSpec,
    WireError,
    build_layout,
    byte_view,
    tensor_views,
)
from diloco.wire.checksum import checksum
from diloco.worker.state.update_buffer import UpdateBuffer

LR = 0.5


def step(theta: torch.Tensor, total: torch.Tensor, divisor: float = 2.0) -> None:
    """The server's step under ``sparseloco``: OuterSGD with momentum 0 on the round's sum
    divided by the total weight, in place on a parameter."""
    param = torch.nn.Parameter(theta, requires_grad=False)
    apply_outer_step(OuterSGD([param], lr=LR, momentum=0.0), [param], [total], divisor=divisor)


def plain_descent(theta: torch.Tensor, uploads: list[torch.Tensor]) -> torch.Tensor:
    """``step`` on the sum of ``uploads`` (weight 1 each); returns the sum."""
    total = torch.zeros_like(theta)
    for u in uploads:
        total.add_(u)
    step(theta, total, divisor=float(len(uploads)))
    return total


def two_by_six() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A 2x6 parameter and two sparse uploads (as decoded ``topk`` bodies would be)."""
    theta = torch.arange(1.0, 13.0).view(2, 6)
    u1 = torch.zeros(2, 6)
    u2 = torch.zeros(2, 6)
    u1[0, 1], u1[0, 4], u1[1, 2] = 2.0, 4.0, -2.0
    u2[0, 4], u2[1, 2], u2[1, 5] = -4.0, -2.0, 8.0  # (0, 4) cancels: the sum there is +0
    return theta, u1, u2


def test_a_2x6_parameter_two_uploads_the_update_and_its_apply_by_hand() -> None:
    theta, u1, u2 = two_by_six()
    old = theta.clone()
    s = plain_descent(theta, [u1, u2])
    # S / W = [(0,1): 1, (1,2): -2, (1,5): 4]; theta - 0.5 * S / W:
    expected = old.clone()
    expected[0, 1], expected[1, 2], expected[1, 5] = 1.5, 10.0, 10.0
    assert torch.equal(theta, expected)
    assert s[0, 4].item() == 0.0 and not torch.signbit(s[0, 4])  # cancelled to +0
    counts, idx, values = encode_changes(s, theta)
    assert counts.tolist() == [3]  # one span; flat positions 1, 8, 11 (not 4: unchanged)
    # 12 bits each: 1 | 8 << 12 | 11 << 24 = 0x0B008001 in 36 bits, 5 bytes little-endian.
    assert idx.dtype == torch.uint8 and idx.tolist() == [0x01, 0x80, 0x00, 0x0B, 0x00]
    assert unpack_positions(idx, 3).tolist() == [1, 8, 11]
    assert values.tolist() == [1.5, 10.0, 10.0]  # the new values, not the differences
    check_update(12, counts, idx, values)
    replica = old.clone()
    apply_changes(replica, counts, idx, values)
    assert torch.equal(replica.view(torch.int32), theta.view(torch.int32))  # the same bits
    assert update_bytes(12, 3) == 2 + 5 + 4 * 3
    assert [(p.suffix, p.dtype, p.shape) for p in parts(12, 3)] == [
        (COUNT, torch.uint16, (1,)),
        (INDEX, torch.uint8, (5,)),
        ("", torch.float32, (3,)),
    ]


def test_a_negative_zero_sum_is_in_the_support_since_it_turns_minus_zero_into_plus_zero() -> None:
    theta = torch.tensor([-0.0, -0.0, 3.0])
    # A sum of -0: a zero-scale topk chunk decodes to -0 at a negative code, and the server's
    # sparse add writes only kept positions, so it can stay -0 there.
    s = torch.tensor([-0.0, 0.0, 0.0])
    step(theta, s)
    assert not torch.signbit(theta[0])  # -0 + (-0.5 * -0 / 2) = -0 + +0 = +0: changed bits
    assert torch.signbit(theta[1])  # +0 in the sum leaves -0 as it was
    counts, idx, values = encode_changes(s, theta)
    assert unpack_positions(idx, 1).tolist() == [0] and counts.tolist() == [1]
    replica = torch.tensor([-0.0, -0.0, 3.0])
    apply_changes(replica, counts, idx, values)
    assert torch.equal(replica.view(torch.int32), theta.view(torch.int32))


def test_outside_the_support_a_random_sparse_round_leaves_every_bit_and_a_replica_matches() -> None:
    gen = torch.Generator().manual_seed(5)
    n = (1 << 20) + SPAN + 3  # crosses the encoder's chunk and ends in a short span
    theta = torch.randn(n, generator=gen)
    uploads = []
    for _ in range(2):
        u = torch.zeros(n)
        keep = torch.randperm(n, generator=gen)[: n // 64]
        u[keep] = torch.randn(keep.numel(), generator=gen)
        uploads.append(u)
    old = theta.clone()
    s = plain_descent(theta, uploads)
    counts, idx, values = encode_changes(s, theta)
    assert counts.numel() == spans(n) == 258 and int(counts.sum()) == values.numel()
    changed = (theta.view(torch.int32) != old.view(torch.int32)).nonzero().view(-1)
    support = (s.view(torch.int32) != 0).nonzero().view(-1)
    assert set(changed.tolist()) <= set(support.tolist())
    assert values.numel() == support.numel() > 0
    want = torch.cat([support[support // SPAN == i] % SPAN for i in range(spans(n))])
    assert torch.equal(unpack_positions(idx, values.numel()), want)
    check_update(n, counts, idx, values)
    replica = old.clone()
    apply_changes(replica, counts, idx, values)
    assert torch.equal(replica.view(torch.int32), theta.view(torch.int32))


def pk(positions: list[int]) -> torch.Tensor:
    return pack_positions(torch.tensor(positions))


def with_padding_bit(idx: torch.Tensor) -> torch.Tensor:
    out = idx.clone()
    out[-1] |= 0x10  # 3 positions are 36 bits: bits 36-39 of the 5 bytes are padding
    return out


def malformed() -> dict[str, tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, str]]:
    def t(values: list[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64).to(dtype)

    c, v, u16 = t([3], torch.uint16), torch.tensor([1.5, 10.0, 10.0]), torch.uint16
    n2 = SPAN + 5
    return {
        "index past the end": (12, c, pk([1, 8, 12]), v, "bad_index"),
        "index past a short last span": (n2, t([1, 2], u16), pk([7, 0, 5]), v, "bad_index"),
        "repeated index": (12, c, pk([1, 8, 8]), v, "bad_index"),
        "unordered indices": (12, c, pk([8, 1, 11]), v, "bad_index"),
        "padding bits set": (12, c, with_padding_bit(pk([1, 8, 11])), v, "bad_index"),
        "counts short of the indices": (12, t([2], u16), pk([1, 8, 11]), v, "bad_shape"),
        "count past its span": (n2, t([SPAN + 1, 2], u16), pk([1, 8, 11]), v, "bad_shape"),
        "too many counts": (12, t([3, 0], u16), pk([1, 8, 11]), v, "bad_shape"),
        "truncated values": (12, c, pk([1, 8, 11]), v[:2], "bad_shape"),
        "truncated indices": (12, c, pk([1, 8, 11])[:4], v, "bad_shape"),
        "NaN value": (12, c, pk([1, 8, 11]), torch.tensor([1.0, float("nan"), 2.0]), "non_finite"),
        "unpacked indices": (12, c, t([1, 8, 11], u16), v, "bad_dtype"),
        "signed counts": (12, t([3], torch.int32), pk([1, 8, 11]), v, "bad_dtype"),
    }


@pytest.mark.parametrize("case", sorted(malformed()))
def test_a_malformed_update_is_refused_with_its_code(case: str) -> None:
    n, counts, idx, values, code = malformed()[case]
    with pytest.raises(CodecError) as info:
        check_update(n, counts, idx, values)
    assert info.value.code == code


def body(
    table: dict[str, tuple[int, ...]],
    sparse: dict[str, tuple[torch.Tensor, ...]],
    meta: dict[str, str],
) -> tuple[Layout, torch.Tensor]:
    """A sparse update body's layout and payload, as the server lays one out."""
    specs = [
        TensorSpec(name + p.suffix, CODE_OF_DTYPE[p.dtype], tuple(t.shape))
        for name in table
        for p, t in zip(parts(1, 0), sparse[name], strict=True)
    ]
    layout = build_layout(specs, {"kind": "update", **metadata(), **meta})
    payload = torch.zeros(layout.payload_size, dtype=torch.uint8)
    views = tensor_views(layout, payload)
    for name in table:
        for p, t in zip(parts(1, 0), sparse[name], strict=True):
            views[name + p.suffix].copy_(t)
    return layout, payload


def test_the_worker_buffer_applies_a_good_body_and_refuses_bad_ones_changing_nothing() -> None:
    theta, u1, u2 = two_by_six()
    old = theta.clone()
    s = plain_descent(theta, [u1, u2])
    table = {"w": (2, 6)}
    counts, idx, values = encode_changes(s, theta)
    meta = {"checksum": checksum([byte_view(theta.view(-1).clone())])}
    snap_payload = old.view(-1).clone()
    snapshot = {"w": snap_payload.view(2, 6)}
    buf = UpdateBuffer()
    layout, payload = body(table, {"w": (counts, idx, values)}, meta)
    memoryview(buf.into(layout, table))[:] = memoryview(payload.numpy()).cast("B")
    buf.check(table)
    assert buf.apply(snapshot, snap_payload)  # the checksum matches: the server's bits
    assert torch.equal(snapshot["w"], theta)
    # A repeated index: refused by check, before apply could write anything.
    snapshot["w"].copy_(old)
    bad = pk([1, 8, 8])
    layout, payload = body(table, {"w": (counts, bad, values)}, meta)
    memoryview(buf.into(layout, table))[:] = memoryview(payload.numpy()).cast("B")
    with pytest.raises(WireError, match="repeated or out of order") as info:
        buf.check(table)
    assert info.value.code == "bad_update"
    assert torch.equal(snapshot["w"], old)
    # Headers that do not fit the model: refused before a byte of payload is taken.
    for wrong in (
        {"w": (counts, idx, values[:2])},  # values short of the indices
        {"w": (counts.repeat(2), idx, values)},  # two counts for one span
    ):
        layout, _ = body(table, wrong, meta)
        with pytest.raises(WireError) as info:
            buf.into(layout, table)
        assert info.value.code == "bad_update"
    layout, _ = body({"v": (2, 6)}, {"v": (counts, idx, values)}, meta)
    with pytest.raises(WireError):
        buf.into(layout, table)  # another parameter's name
    # An older server's update (no codec_index_bits): refused by name, so the worker downloads
    # full parameters instead (worker/session.py).
    layout, _ = body(table, {"w": (counts, idx, values)}, {**meta, "codec_index_bits": ""})
    with pytest.raises(WireError, match="another diloco version") as info:
        buf.into(layout, table)
    assert info.value.code == "bad_update"
