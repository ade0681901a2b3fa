"""The sparse top-k codec (core/codecs/topk.py, issue 30 item 1) against hand-computed parts and
values; its bytes per element; every malformed part refused with its code before anything is
added; the scatter-add equal to decoding then adding, bit for bit; pieces; its options; and
error feedback with a decay (core/codecs/error_feedback.py) against numbers computed by hand."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from diloco.core.accumulate import WeightedSum, accumulate_
from diloco.core.codecs import (
    CodecError,
    Encoded,
    ErrorFeedback,
    Part,
    TopKCodec,
    codec_by_name,
    codec_from_metadata,
    codec_metadata,
)
from diloco.core.codecs.downlink import check_download_codec
from diloco.demo.model import build_model
from diloco.server.config import DOWNLOAD_CODECS
from diloco.wire import CODE_OF_DTYPE, TensorSpec, build_layout
from diloco.worker.settings import parse_codec
from tests.helpers import topk_records as records

BF16, U16, U8 = torch.bfloat16, torch.uint16, torch.uint8


def gen_randn(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


# --- the layout and the values, by hand ----------------------------------------------------------


def test_a_2x6_tensor_in_chunks_of_4_at_density_half_and_8_bits() -> None:
    codec = TopKCodec(density=0.5, chunk=4, bits=8)
    t = torch.tensor([[1.0, -4.0, 0.5, 2.0, 3.0, -0.25], [-6.0, 1.5, 0.125, -0.0625, 0.375, 0.5]])
    # Three chunks of 4, each keeping its 2 largest magnitudes; top = 255, codes j stand for
    # (2j - 255) * s, s = absmax / 255 rounded up to bf16 (8 significant bits):
    # chunk 0 [1, -4, 0.5, 2]: keeps -4 and 2; 4/255 = 2**-6 * 1.0039 -> s = 129 / 8192;
    #   -4/s = -254.02 -> j = round(0.98 / 2) = 0; 2/s = 127.01 -> j = round(382.01 / 2) = 191.
    # chunk 1 [3, -0.25, -6, 1.5]: keeps 3 and -6; 6/255 = 2**-6 * 1.5059 -> s = 193 / 8192;
    #   3/s = 127.34 -> j = 191; -6/s = -254.67 -> j = 0.
    # chunk 2 [0.125, -0.0625, 0.375, 0.5]: keeps 0.375 and 0.5; 0.5/255 -> s = 129 / 65536;
    #   0.375/s = 190.51 -> j = round(445.51 / 2) = 223; 0.5/s = 254.02 -> j = 255.
    # A record: the bf16 scale (2 bytes), two 2-bit positions in one byte, two 8-bit codes.
    assert codec.index_bits == 2
    assert codec.parts(t.shape) == [Part("", U8, (15,))]
    (data,) = codec.encode(t)
    # 129 / 8192 = 2**-6 * (1 + 2**-7): bf16 0x3C81, little-endian; positions 1 | 3 << 2 = 13.
    assert data[:5].tolist() == [0x81, 0x3C, 13, 0, 191]
    recs = records.read(codec, data, 12)
    assert [r.scale for r in recs] == [129 / 8192, 193 / 8192, 129 / 65536]
    assert [r.positions for r in recs] == [[1, 3], [0, 2], [2, 3]]
    assert [r.packed for r in recs] == [[13], [8], [14]]
    assert [r.codes for r in recs] == [[0, 191], [191, 0], [223, 255]]
    want = torch.tensor(
        [
            [0.0, -255 * 129 / 8192, 0.0, 127 * 129 / 8192, 127 * 193 / 8192, 0.0],
            [-255 * 193 / 8192, 0.0, 0.0, 0.0, 191 * 129 / 65536, 255 * 129 / 65536],
        ]
    )
    assert torch.equal(codec.decode([data], t.shape), want)


def test_a_short_last_chunk_keeps_its_own_count_and_two_bit_codes_pack_four_per_byte() -> None:
    codec = TopKCodec(density=0.5, chunk=4, bits=2)
    t = torch.tensor([0.0, 3.0, -1.0, 0.5, 0.25, -3.0, 1.0])  # chunks [0, 3, -1, .5], [.25, -3, 1]
    # Chunk 0 keeps 3 and -1: s = 3/3 = 1; codes round((x/s + 3) / 2): 3 -> 3, -1 -> 1.
    # The last chunk (3 elements) keeps round(1.5) = 2: -3 and 1; s = 1: -3 -> 0, 1 -> 2.
    # Each chunk's two 2-bit codes fill one byte, code m at bit 2m: 3 | 1 << 2 = 7; 0 | 2 << 2 = 8.
    # Positions [1, 2] in 2 bits each: 1 | 2 << 2 = 9. A scale of 1.0 is bf16 0x3F80.
    (data,) = codec.encode(t)
    assert data.tolist() == [0x80, 0x3F, 9, 7, 0x80, 0x3F, 9, 8]
    assert codec.decode([data], t.shape).tolist() == [0, 3, -1, 0, 0, -3, 1]


def test_positions_pack_in_log2_chunk_bits_each_chunk_on_whole_bytes() -> None:
    # chunk 4096: 12 bits; 3 kept positions = 36 bits -> 5 bytes, the top 4 bits of the last 0.
    codec = TopKCodec(density=3 / 4096, chunk=4096, bits=8)
    t = torch.zeros(2 * 4096)
    t[[5, 1000, 4095]] = torch.tensor([1.0, -2.0, 3.0])
    t[4096 + 4094] = 7.0  # chunk 1 keeps 4094 and two zeros (the lowest positions among ties)
    (data,) = codec.encode(t)
    assert codec.index_bits == 12 and codec.record(4096) == 2 + 5 + 3
    packed = records.read(codec, data, t.numel())[0].packed
    # 5 | 1000 << 12 | 4095 << 24, little-endian: 0x0FFF3E8005.
    assert packed == [0x05, 0x80, 0x3E, 0xFF, 0x0F]
    assert [r.positions for r in records.read(codec, data, t.numel())][0] == [5, 1000, 4095]
    assert torch.equal(codec.decode([data], t.shape)[[5, 1000, 4095, 8190]] != 0, torch.ones(4) > 0)
    for chunk, width in [(1, 1), (2, 1), (1024, 10), (2048, 11), (65536, 16)]:
        assert TopKCodec(chunk=chunk).index_bits == width


def test_the_kept_count_is_fixed_by_the_chunk_length() -> None:
    codec = TopKCodec(density=0.01, chunk=64, bits=4)
    # 64 * 0.01 = 0.64 -> 1 per full chunk; the last chunk of 3 keeps max(1, 0) = 1:
    # records of 2 (scale) + 1 (one 6-bit position) + 1 (one 4-bit code) bytes.
    assert [p.shape for p in codec.parts((67,))] == [(8,)]
    wide = TopKCodec(density=0.25, chunk=16, bits=4)
    # 100 = 6 * 16 + 4: k = 4 per full chunk (2 + 2 + 2 bytes), 1 in the last (2 + 1 + 1).
    assert [p.shape for p in wide.parts((100,))] == [(6 * 6 + 4,)]
    assert [p.shape for p in wide.parts((0,))] == [(0,)]
    whole = TopKCodec(density=1.0, chunk=8, bits=8)  # keeps every element
    assert records.read(whole, whole.encode(torch.ones(5))[0], 5)[0].positions == [0, 1, 2, 3, 4]


def test_bytes_per_element_at_sparseloco_settings() -> None:
    codec = codec_by_name("topk", density=0.0156, chunk=4096, bits=2)
    n = 4096 * 256
    per_element = codec.nbytes((n,)) / n
    # k = round(63.9) = 64 per chunk: a 2-byte scale, 64 12-bit positions, 64 2-bit codes.
    assert per_element == (2 + 64 * 12 // 8 + 64 // 4) / 4096
    ratio = 4 / per_element
    print(
        f"topk density 0.0156 chunk 4096 bits 2: {per_element:.4f} bytes/element, {ratio:.0f}x below fp32"
    )
    assert ratio >= 140  # 112x with uint16 positions


# --- refusals ------------------------------------------------------------------------------------

CODEC = TopKCodec(density=0.25, chunk=8, bits=4)
SHAPE = (3, 7)  # 21 = 2 * 8 + 5: two full chunks of k = 2, a last chunk of 5 keeping 1
# Records of 2 + 1 + 1 bytes: positions 3 bits each (6 of the byte for k = 2, 3 for k = 1).


def good_parts() -> list[torch.Tensor]:
    return [p.clone() for p in CODEC.encode(gen_randn(21, 1).view(SHAPE))]


Forgery = Callable[[list[records.Record]], None]


def forged(change: Forgery, *, repack: bool = True) -> Callable[[list[torch.Tensor]], None]:
    def apply(parts: list[torch.Tensor]) -> None:
        recs = records.read(CODEC, parts[0], 21)
        change(recs)
        parts[0] = records.write(CODEC, recs, repack=repack)

    return apply


def set_scale(chunk: int, value: float) -> Forgery:
    def change(recs: list[records.Record]) -> None:
        recs[chunk].scale = value

    return change


def set_position(chunk: int, k: int, value: int) -> Forgery:
    def change(recs: list[records.Record]) -> None:
        recs[chunk].positions[k] = value

    return change


def swap_first_two(recs: list[records.Record]) -> None:
    recs[0].positions.reverse()


def repeat_first(recs: list[records.Record]) -> None:
    recs[1].positions[1] = recs[1].positions[0]


def set_padding_bit(recs: list[records.Record]) -> None:
    recs[1].packed[0] |= 0x80  # bits 6 and 7 of a byte holding two 3-bit positions


MALFORMED: dict[str, tuple[Callable[[list[torch.Tensor]], None], str]] = {
    # A full chunk's 3-bit positions cannot leave its 8 elements: only the short one can.
    "index past the short last chunk": (forged(set_position(2, 0, 5)), "bad_index"),
    "index at the widest field past the short last chunk": (
        forged(set_position(2, 0, 7)),
        "bad_index",
    ),
    "indices out of order": (forged(swap_first_two), "bad_index"),
    "a repeated index": (forged(repeat_first), "bad_index"),
    "padding bits set": (forged(set_padding_bit, repack=False), "bad_index"),
    "a NaN scale": (forged(set_scale(1, float("nan"))), "non_finite"),
    "an infinite scale": (forged(set_scale(2, float("inf"))), "non_finite"),
    "a scale decoding past fp32": (forged(set_scale(0, 3e38)), "non_finite"),
    "a negative scale": (forged(set_scale(0, -1.0)), "bad_scale"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_part_is_refused_with_its_code_before_anything_is_added(case: str) -> None:
    change, code = MALFORMED[case]
    parts = good_parts()
    CODEC.check(parts, SHAPE)  # the good body passes
    change(parts)
    wsum = WeightedSum([SHAPE])
    wsum.add([gen_randn(21, 2).view(SHAPE)], 1.0)
    before = wsum.sums[0].clone()
    entry = Encoded.of(CODEC, parts, SHAPE)
    with pytest.raises(CodecError) as info:
        entry.check()  # what the server runs on every part before the add
    assert info.value.code == code
    assert torch.equal(wsum.sums[0], before) and wsum.count == 1


@pytest.mark.parametrize(
    ("layout", "code"),
    [
        ([(U8, (13,))], "bad_shape"),  # one byte too many
        ([(U8, (11,))], "bad_shape"),  # one code byte too few
        ([(U8, (8,))], "bad_shape"),  # a chunk's record missing
        ([(BF16, (6,))], "bad_dtype"),
        ([(U16, (6,))], "bad_dtype"),
        ([(BF16, (3,)), (U16, (5,)), (U8, (3,))], "bad_parts"),  # the unpacked format
    ],
)
def test_wrong_counts_and_dtypes_are_refused_from_the_header(
    layout: list[tuple[torch.dtype, tuple[int, ...]]], code: str
) -> None:
    assert [(p.dtype, p.shape) for p in CODEC.parts(SHAPE)] == [(U8, (12,))]
    with pytest.raises(CodecError) as info:
        CODEC.check_layout(SHAPE, layout)
    assert info.value.code == code


# --- accumulating --------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize(("chunk", "n"), [(1, 37), (16, 1000), (4096, 3 * (1 << 20) // 2 + 77)])
def test_add_into_is_decode_then_add_bit_for_bit(bits: int, chunk: int, n: int) -> None:
    codec = TopKCodec(density=0.03, chunk=chunk, bits=bits)
    parts = codec.encode(gen_randn(n, 3))
    codec.check(parts, (n,))
    decoded = codec.decode(parts, (n,))
    full, rest = divmod(n, chunk)
    assert int((decoded != 0).sum()) <= full * codec.kept(chunk) + codec.kept(rest)
    for weight, first in [(0.5, False), (1 / 3, False), (-1.0, False), (0.7, True), (1.0, True)]:
        acc = gen_randn(n, 4)
        want = acc.clone()
        codec.add_into(acc, parts, weight, first=first)
        accumulate_(want, decoded, weight, first)
        assert torch.equal(acc.view(torch.int32), want.view(torch.int32)), (weight, first)


def test_pieces_aligned_to_the_chunk_concatenate_to_the_whole() -> None:
    codec = TopKCodec(density=0.1, chunk=64, bits=2)
    n = 64 * 40 + 9
    t = gen_randn(n, 5)
    whole = codec.encode(t)
    cuts = [0, 640, 64 * 33, n]
    pieces = [codec.encode_piece(t[a:b]) for a, b in zip(cuts, cuts[1:], strict=False)]
    for i, part in enumerate(whole):
        assert torch.equal(part, torch.cat([p[i] for p in pieces]))
    for (a, b), p in zip(zip(cuts, cuts[1:], strict=False), pieces, strict=True):
        ranges = codec.piece_ranges(n, a, b)
        assert all(torch.equal(w[s:e], q) for w, (s, e), q in zip(whole, ranges, p, strict=True))
    with pytest.raises(ValueError, match="multiple of 64"):
        codec.piece_ranges(n, 10, 64)


def test_an_all_zero_chunk_decodes_to_zeros() -> None:
    codec = TopKCodec(density=0.5, chunk=4, bits=2)
    parts = codec.encode(torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0, -2.0, 0.0, 0.0]))
    assert records.read(codec, parts[0], 8)[0].scale == 0.0
    assert codec.decode(parts, (8,))[:4].tolist() == [0.0] * 4


# --- options -------------------------------------------------------------------------------------


def test_options_parse_round_trip_and_keep_it_out_of_the_downlink() -> None:
    codec = parse_codec("topk:density=0.0156,chunk=4096,bits=2")
    assert isinstance(codec, TopKCodec)
    assert (codec.density, codec.chunk, codec.bits) == (0.0156, 4096, 2)
    assert codec == parse_codec("topk") == parse_codec("topk:0.0156")
    assert codec_metadata(codec) == {
        "codec": "topk",
        "codec_density": "0.0156",
        "codec_chunk": "4096",
        "codec_bits": "2",
        "codec_index_bits": "12",
    }
    assert codec_from_metadata(codec_metadata(codec)) == codec
    assert parse_codec("topk:chunk=1024,index_bits=10") == parse_codec("topk:chunk=1024")
    assert parse_codec("topk:density=0.03,bits=8") != codec
    assert "topk" not in DOWNLOAD_CODECS
    with pytest.raises(ValueError, match="cannot carry a published update"):
        check_download_codec(codec)


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("topk:density=0", "density must be in"),
        ("topk:density=1.5", "density must be in"),
        ("topk:density=-0.1", "density must be in"),
        ("topk:density=nan", "density must be in"),
        ("topk:density=many", "not a number"),
        ("topk:chunk=0", "chunk must be a power of two from 1 to 65536"),
        ("topk:chunk=131072", "chunk must be"),
        ("topk:chunk=3000", "chunk must be"),
        ("topk:chunk=4.5", "not an integer"),
        ("topk:bits=3", "bits must be one of 2, 4, 8"),
        ("topk:bits=16", "bits must be"),
        ("topk:block=64", "block"),
        ("topk:index_bits=16", "index_bits must be 12"),
        ("topk:index_bits=x", "not an integer"),
    ],
)
def test_bad_options_are_refused(spec: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_codec(spec)
    name, _, rest = spec.partition(":")
    key, _, value = rest.partition("=")
    with pytest.raises(CodecError, match=match) as info:  # a peer's metadata names index_bits
        codec_from_metadata({"codec": name, "codec_index_bits": "12", f"codec_{key}": value})
    assert info.value.code == "bad_option"


def test_metadata_from_before_the_packed_positions_is_refused_by_name() -> None:
    """The wire stays one format: an older peer's topk metadata (no ``codec_index_bits``, uint16
    positions in three parts) is refused, 400 ``bad_option``, naming the missing option; an
    older peer refuses this one's ``codec_index_bits`` as an unknown option the same way."""
    old = {"codec": "topk", "codec_density": "0.0156", "codec_chunk": "4096", "codec_bits": "2"}
    with pytest.raises(CodecError) as info:
        codec_from_metadata(old)
    assert info.value.code == "bad_option" and "codec_index_bits" in info.value.detail
    assert "older diloco" in info.value.detail
    assert codec_from_metadata({**old, "codec_index_bits": "12"}) == TopKCodec()


# --- error feedback with a decay -----------------------------------------------------------------


def test_error_feedback_with_decay_by_hand() -> None:
    # chunk 2, density 0.5: each pair sends its larger element. 8 bits and an absmax of
    # 255 * 2**-8 make s = 2**-8 exact, so the sent element is exact and the residual is
    # exactly what was dropped.
    codec = TopKCodec(density=0.5, chunk=2, bits=8)
    big = 255 * 2.0**-8
    fb = ErrorFeedback(decay=0.5)
    sent = codec.decode(fb.encode(codec, "w", torch.tensor([big, 0.25])), (2,))
    assert sent.tolist() == [big, 0.0] and fb.residuals["w"].tolist() == [0.0, 0.25]
    # c = g + 0.5 * e = [0.5, 0.87109375 + 0.125]: the second element goes, the first stays.
    g2 = torch.tensor([0.5, big - 0.125])
    twin = ErrorFeedback(decay=0.5)
    twin.residuals["w"] = fb.residuals["w"].clone()
    parts = fb.encode(codec, "w", g2)
    assert codec.decode(parts, (2,)).tolist() == [0.0, big]
    assert fb.residuals["w"].tolist() == [0.5, 0.0]
    twin.commit(codec, "w", g2, parts)  # a worker's later commit: the same bits
    assert torch.equal(twin.residuals["w"], fb.residuals["w"])
    # Without decay the same second round carries all of the residual: c = [0.5, big + 0.125].
    plain = ErrorFeedback()
    plain.residuals["w"] = torch.tensor([0.0, 0.25])
    plain.encode(codec, "w", g2)
    assert plain.decay == 1.0 and plain.residuals["w"][0].item() == 0.5


def test_the_default_decay_keeps_todays_bits_and_a_bad_decay_is_refused() -> None:
    codec = codec_by_name("int8")
    g = [gen_randn(5000, s) for s in range(3)]
    default, explicit = ErrorFeedback(), ErrorFeedback(decay=1.0)
    for t in g:
        a, b = default.encode(codec, "x", t), explicit.encode(codec, "x", t)
        assert all(torch.equal(p, q) for p, q in zip(a, b, strict=True))
    assert torch.equal(default.residuals["x"], explicit.residuals["x"])
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="decay must be in"):
            ErrorFeedback(decay=bad)


def test_error_feedback_keeps_the_invariant_with_topk() -> None:
    codec = TopKCodec(density=0.05, chunk=64, bits=2)
    fb = ErrorFeedback()
    sent, true = torch.zeros(3000), torch.zeros(3000)
    for r in range(5):
        g = gen_randn(3000, 10 + r)
        sent += codec.decode(fb.encode(codec, "v", g), (3000,))
        true += g
    torch.testing.assert_close(sent + fb.residuals["v"], true, rtol=1e-5, atol=1e-5)


def test_a_body_at_the_quality_suites_model_is_50x_below_fp32_headers_included() -> None:
    """Claim n's upload (docs/benchmarks.md, "Sparse top-k codec"): on the 137k-parameter model
    one header entry per tensor, and the whole body (header, codec metadata, payload) at least
    50x below the fp32 payload; three entries per tensor made it 42x."""
    model = build_model(0, 64)
    codec = parse_codec("topk:density=0.0156,chunk=1024,bits=2")
    specs = [
        TensorSpec(name + part.suffix, CODE_OF_DTYPE[part.dtype], part.shape)
        for name, p in model.named_parameters()
        for part in codec.parts(p.shape)
    ]
    layout = build_layout(specs, codec_metadata(codec), ordered=True)
    n = sum(p.numel() for p in model.parameters())
    assert len(layout.specs) == len(list(model.parameters())) == 29
    assert 4 * n / layout.total_size >= 50
    assert layout.payload_size > len(layout.header)  # the header no longer outweighs the values
