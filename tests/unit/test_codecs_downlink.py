"""The compressed downlink's maths (core/codecs/downlink.py): the server's error feedback keeps
``true - published`` within one round's quantization error, replicas applying the published parts
end bit-identical to the server, and the checksum tells equal parameters from different ones."""

from __future__ import annotations

import pytest
import torch

from diloco.core.codecs import Bf16Codec, Fp32Codec, Int4Codec, Int8Codec, LowRankCodec
from diloco.core.codecs.base import CHUNK
from diloco.core.codecs.downlink import apply_update, check_download_codec, encode_update
from diloco.wire.checksum import checksum, tensor_checksum


def test_hand_computed_update_of_one_block() -> None:
    # One int8 block of 4 (block 64 pads nothing: the block is the tensor). true - published =
    # [1.27, -0.635, 0, 0.01]: absmax 1.27, scale 0.01 (rounded up to bf16: 0.010009765625),
    # codes round(u / s) = [127, -63, 0, 1]; published moves by codes * s.
    codec = Int8Codec()
    published = torch.tensor([1.0, 2.0, 3.0, 4.0])
    true = published + torch.tensor([1.27, -0.635, 0.0, 0.01])
    before = published.clone()
    scale_part, codes = encode_update(codec, true, published)
    s = torch.tensor(0.01).to(torch.bfloat16)
    s = s if float(s) >= 0.01 else torch.nextafter(s, torch.tensor(1.0, dtype=torch.bfloat16))
    assert scale_part.tolist() == [float(s)]
    assert codes.tolist() == [127, -63, 0, 1]
    expected = before + torch.tensor([127.0, -63.0, 0.0, 1.0]) * float(s)
    assert torch.equal(published, expected)


@pytest.mark.parametrize("codec", [Int8Codec(), Int4Codec(), Bf16Codec()], ids=lambda c: c.name)
def test_replicas_stay_bit_identical_and_the_gap_does_not_grow(codec) -> None:
    gen = torch.Generator().manual_seed(0)
    n = 3 * CHUNK + 1000  # several chunks and a partial block at the end
    true = torch.randn(n, generator=gen)
    published = true.clone()  # round 0: every replica downloads full parameters
    replicas = [published.clone(), published.clone()]
    step_sizes = []
    for _ in range(6):
        step = torch.randn(n, generator=gen) * 1e-3
        true -= step  # the outer step, on the true copy only
        parts = encode_update(codec, true, published)
        for replica in replicas:
            apply_update(codec, replica, parts)
            assert torch.equal(replica, published)  # bit for bit
        step_sizes.append(float(step.abs().max()))
        gap = (true - published).abs().max()
        # Error feedback: the gap is one round's rounding, never the sum of all rounds'.
        bound = {"int8": 1 / 127, "int4": 1 / 7, "bf16": 2**-8}[codec.name]
        assert float(gap) <= bound * max(step_sizes[-1], 1e-3) * 2 + 1e-6


def test_without_feedback_the_gap_would_grow() -> None:
    # The same updates, but each round encoding only the step (no residual carried): the check
    # above would fail, so it measures what error feedback does.
    codec = Int4Codec()
    gen = torch.Generator().manual_seed(1)
    true = torch.zeros(4096)
    naive = true.clone()
    fed = true.clone()
    for _ in range(20):
        step = torch.randn(4096, generator=gen) * 1e-3 + 3e-4  # a drift the rounding keeps losing
        true += step
        apply_update(codec, naive, codec.encode_piece(step))
        encode_update(codec, true, fed)
    assert float((true - fed).abs().max()) < float((true - naive).abs().max()) / 3


def test_pieces_give_the_same_parts_and_bits_as_the_whole() -> None:
    codec = Int8Codec()
    gen = torch.Generator().manual_seed(2)
    true = torch.randn(2 * CHUNK + 64 * 5, generator=gen)
    base = torch.randn(true.numel(), generator=gen)
    whole_pub = base.clone()
    whole = encode_update(codec, true, whole_pub)
    piece_pub = base.clone()
    cut = CHUNK + 64
    first = encode_update(codec, true[:cut], piece_pub[:cut])
    second = encode_update(codec, true[cut:], piece_pub[cut:])
    assert torch.equal(piece_pub, whole_pub)
    for w, a, b in zip(whole, first, second, strict=True):
        assert torch.equal(w, torch.cat([a, b]))


def test_only_element_wise_lossy_codecs_carry_updates() -> None:
    assert check_download_codec(Int8Codec()).name == "int8"
    for bad in (Fp32Codec(), LowRankCodec(rank=2), "int8"):
        with pytest.raises(ValueError, match="cannot carry a published update"):
            check_download_codec(bad)


def test_checksum_sees_one_flipped_bit_and_ignores_how_bytes_are_split() -> None:
    t = torch.randn(10_000, generator=torch.Generator().manual_seed(3))
    same = tensor_checksum([t])
    assert tensor_checksum([t[:1234], t[1234:]]) == same
    flipped = t.clone()
    flipped.view(torch.int32)[777] ^= 1  # one ulp
    assert tensor_checksum([flipped]) != same
    assert checksum([b""]) == "00000000"
    assert len(same) == 8 and int(same, 16) >= 0
