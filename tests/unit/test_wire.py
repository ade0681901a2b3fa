"""The safetensors-layout wire format: round trips, interop with the reference library, streaming
readers (blocking and asyncio), rejection of malformed bodies, table checks and zero-copy views.

Tensors are generated from raw bytes, so float payloads include NaNs, infinities and subnormals;
every comparison is on the bytes, never on values.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import string
import struct
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import pytest
import safetensors
import safetensors.torch
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diloco.wire import (
    DTYPE_CODES,
    Layout,
    PayloadReader,
    TensorSpec,
    WireError,
    aread_layout,
    aread_payload,
    build_layout,
    byte_view,
    check_against,
    decode,
    encode,
    iter_body,
    read_layout,
    read_payload,
    readinto_payload,
    spec_of,
    tensor_views,
)

# Deterministic and quick: the same examples on every run, no example database on disk.
FAST = settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
FUZZ = settings(FAST, max_examples=150)

#: Every code a malformed body may legitimately produce on the read path.
READ_CODES = {"truncated", "bad_header", "bad_dtype", "header_too_large", "trailing_bytes"}

# --- helpers ----------------------------------------------------------------------------------


def raw_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def from_bytes(raw: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if not raw:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)


def assert_same_tensors(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for name, w in want.items():
        g = got[name]
        assert g.dtype == w.dtype, name
        assert tuple(g.shape) == tuple(w.shape), name
        assert raw_bytes(g) == raw_bytes(w), name


def body_of(header: object, payload: bytes = b"") -> bytes:
    """A body with a correct length prefix around ``header`` (a JSON value or raw bytes)."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + payload


def entry(dtype: object, shape: object, offsets: object) -> dict[str, object]:
    return {"dtype": dtype, "shape": shape, "data_offsets": offsets}


def piecewise(data: bytes, rng: random.Random) -> Callable[[int], bytes]:
    """A blocking ``read(n)`` that returns between 1 and n bytes at a time, b"" at the end."""
    pos = 0

    def read(n: int) -> bytes:
        nonlocal pos
        assert n > 0, "readers must never ask for zero or 'all' bytes"
        part = data[pos : pos + rng.randint(1, n)]
        pos += len(part)
        return part

    return read


class PiecewiseStream:
    """A stand-in for aiohttp's StreamReader that hands out random-sized pieces."""

    def __init__(self, data: bytes, rng: random.Random) -> None:
        self._read = piecewise(data, rng)

    async def read(self, n: int = -1) -> bytes:
        await asyncio.sleep(0)  # let the loop run between pieces, as a socket would
        return self._read(n)


def read_into_blocking(body: bytes, seed: int) -> tuple[Layout, bytes]:
    """The worker's download path: the payload written straight into its destination by a
    ``readinto`` that fills only part of what it is offered each time."""
    rng = random.Random(seed)
    read = piecewise(body, rng)

    def readinto(dest: memoryview) -> int:
        part = read(len(dest)) if len(dest) else b""
        dest[: len(part)] = part
        return len(part)

    layout = read_layout(read)
    payload = torch.empty(layout.payload_size, dtype=torch.uint8)
    readinto_payload(readinto, read, byte_view(payload))
    return layout, raw_bytes(payload)


def read_blocking(body: bytes, seed: int, chunk: int = 1 << 20) -> tuple[Layout, bytes]:
    read = piecewise(body, random.Random(seed))
    layout = read_layout(read)
    payload = torch.empty(layout.payload_size, dtype=torch.uint8)
    read_payload(read, byte_view(payload), chunk_bytes=chunk)
    return layout, raw_bytes(payload)


async def _read_async(body: bytes, seed: int, chunk: int) -> tuple[Layout, bytes]:
    stream = PiecewiseStream(body, random.Random(seed))
    layout = await aread_layout(stream)
    payload = torch.empty(layout.payload_size, dtype=torch.uint8)
    await aread_payload(stream, byte_view(payload), chunk_bytes=chunk)
    return layout, raw_bytes(payload)


def read_async(body: bytes, seed: int, chunk: int = 1 << 20) -> tuple[Layout, bytes]:
    return asyncio.run(_read_async(body, seed, chunk))


def all_readers(seed: int, chunk: int) -> list[Callable[[bytes], object]]:
    """decode, and the blocking, readinto and asyncio streaming readers fed in random-sized pieces."""
    return [
        decode,
        lambda b: read_blocking(b, seed, chunk),
        lambda b: read_async(b, seed, chunk),
        lambda b: read_into_blocking(b, seed),
    ]


def decode_or_wire_error(data: bytes, max_header: int | None = None) -> WireError | None:
    """Decode; a WireError is returned, any other exception escapes and fails the test."""
    try:
        layout, tensors = decode(data) if max_header is None else decode(data, max_header)
    except WireError as exc:
        assert exc.code in READ_CODES, exc.code
        assert exc.status == (413 if exc.code == "header_too_large" else 400)
        assert exc.detail and str(exc) == exc.detail
        return None
    # Whatever decodes must account for every byte and match its own header.
    assert layout.total_size == len(data)
    assert set(tensors) == set(layout.names())
    for spec in layout.specs:
        assert tensors[spec.name].dtype == spec.torch_dtype
        assert tuple(tensors[spec.name].shape) == spec.shape
    return None


# --- strategies -------------------------------------------------------------------------------

NAMES = st.text(
    alphabet=string.ascii_letters + string.digits + "._-", min_size=1, max_size=12
).filter(lambda n: n != "__metadata__")
SHAPES = st.lists(st.integers(0, 4), max_size=3).map(tuple)
ROUND_TRIP_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8]
ALL_DTYPES = list(DTYPE_CODES.values())


@st.composite
def tensors_of(draw: st.DrawFn, dtypes: list[torch.dtype]) -> torch.Tensor:
    dtype = draw(st.sampled_from(dtypes))
    shape = draw(SHAPES)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if dtype is torch.bool:  # only 0/1 bytes are valid bools
        raw = bytes(draw(st.lists(st.integers(0, 1), min_size=nbytes, max_size=nbytes)))
    else:
        raw = draw(st.binary(min_size=nbytes, max_size=nbytes))
    return from_bytes(raw, dtype, shape)


TENSOR_DICTS = st.dictionaries(NAMES, tensors_of(ROUND_TRIP_DTYPES), max_size=5)
NONEMPTY_TENSOR_DICTS = st.dictionaries(
    NAMES, tensors_of(ROUND_TRIP_DTYPES), min_size=1, max_size=4
)
ANY_DTYPE_DICTS = st.dictionaries(NAMES, tensors_of(ALL_DTYPES), max_size=5)
METADATA = st.dictionaries(st.text(max_size=8), st.text(max_size=12), max_size=4)


# --- 1. round trips ---------------------------------------------------------------------------


@FAST
@given(tensors=TENSOR_DICTS, metadata=METADATA)
def test_decode_inverts_encode(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    body = encode(tensors, metadata)
    layout, out = decode(body)
    assert_same_tensors(out, tensors)
    assert dict(layout.metadata) == metadata
    assert layout.total_size == len(body)
    assert sorted(layout.names()) == sorted(tensors)
    # The header is padded so the payload starts 8-byte aligned, as the reference writer does.
    assert len(layout.header) % 8 == 0


@FAST
@given(tensors=ANY_DTYPE_DICTS, metadata=METADATA)
def test_round_trip_covers_every_supported_dtype(
    tensors: dict[str, torch.Tensor], metadata: dict[str, str]
) -> None:
    _, out = decode(encode(tensors, metadata))
    assert_same_tensors(out, tensors)


@FAST
@given(tensors=ANY_DTYPE_DICTS, metadata=METADATA)
def test_reference_reader_opens_our_bodies(
    tensors: dict[str, torch.Tensor], metadata: dict[str, str]
) -> None:
    body = encode(tensors, metadata)
    assert_same_tensors(safetensors.torch.load(body), tensors)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "body.safetensors"
        path.write_bytes(body)
        with safetensors.safe_open(str(path), framework="pt") as f:
            assert (f.metadata() or {}) == metadata
            assert set(f.keys()) == set(tensors)


@FAST
@given(
    tensors=TENSOR_DICTS,
    metadata=METADATA,
    chunk=st.integers(1, 40),
)
def test_iter_body_streams_exactly_what_encode_returns(
    tensors: dict[str, torch.Tensor], metadata: dict[str, str], chunk: int
) -> None:
    layout = build_layout([spec_of(n, t) for n, t in tensors.items()], metadata)
    asked: list[str] = []

    def produce(spec: TensorSpec) -> torch.Tensor:
        asked.append(spec.name)
        return tensors[spec.name]

    pieces = iter_body(layout, produce, chunk_bytes=chunk)
    first = next(pieces)
    assert bytes(first) == layout.header
    assert asked == []  # nothing is produced before it is about to be sent
    rest = list(pieces)
    assert all(0 < len(p) <= chunk for p in rest)
    assert bytes(first) + b"".join(bytes(p) for p in rest) == encode(tensors, metadata)
    assert asked == layout.names()  # each tensor produced once, in payload order


@FAST
@given(
    tensors=TENSOR_DICTS,
    metadata=METADATA,
    seed=st.integers(0, 2**32 - 1),
    chunk=st.integers(1, 64),
)
def test_blocking_readinto_and_asyncio_readers_agree(
    tensors: dict[str, torch.Tensor], metadata: dict[str, str], seed: int, chunk: int
) -> None:
    body = encode(tensors, metadata)
    want_layout, want = decode(body)
    sync_layout, sync_payload = read_blocking(body, seed, chunk)
    async_layout, async_payload = read_async(body, seed + 1, chunk)
    into_layout, into_payload = read_into_blocking(body, seed + 2)
    assert sync_layout == async_layout == into_layout == want_layout
    assert sync_payload == async_payload == into_payload == body[len(want_layout.header) :]
    payload = torch.tensor(list(async_payload), dtype=torch.uint8)
    assert_same_tensors(tensor_views(async_layout, payload), tensors)


def test_encode_accepts_non_contiguous_tensors() -> None:
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()
    assert not t.is_contiguous()
    _, out = decode(encode({"t": t, "s": t[::2, 1:]}))
    assert torch.equal(out["t"], t) and torch.equal(out["s"], t[::2, 1:])


def test_encode_rejects_reserved_name_and_unsupported_dtype() -> None:
    with pytest.raises(WireError) as exc:
        encode({"__metadata__": torch.zeros(1)})
    assert exc.value.code == "bad_name"
    with pytest.raises(WireError) as exc:
        encode({"c": torch.zeros(2, dtype=torch.complex64)})
    assert exc.value.code == "bad_dtype"


def test_iter_body_refuses_a_tensor_that_does_not_match_its_header() -> None:
    layout = build_layout([spec_of("w", torch.zeros(2, 3))])
    with pytest.raises(WireError) as exc:
        list(iter_body(layout, lambda spec: torch.zeros(3, 2)))
    assert exc.value.code == "internal"
    with pytest.raises(WireError):
        list(iter_body(layout, lambda spec: torch.zeros(2, 3, dtype=torch.float64)))


# --- 2. bodies from the reference writer ------------------------------------------------------


@FAST
@given(tensors=ANY_DTYPE_DICTS, metadata=METADATA)
def test_decode_reads_reference_writer_bodies(
    tensors: dict[str, torch.Tensor], metadata: dict[str, str]
) -> None:
    body = safetensors.torch.save(tensors, metadata=metadata or None)
    layout, out = decode(body)
    assert_same_tensors(out, tensors)
    assert dict(layout.metadata) == metadata
    assert read_async(body, 7, 5)[0] == layout


def test_decode_copes_with_unaligned_offsets_from_a_foreign_writer() -> None:
    # One byte first, then fp32 and int64 data that start at odd offsets, and an unpadded header.
    floats = torch.tensor([1.5, -2.0, float("inf")], dtype=torch.float32)
    ints = torch.tensor([-1, 2**40], dtype=torch.int64)
    header = {
        "b": entry("U8", [1], [0, 1]),
        "f": entry("F32", [3], [1, 13]),
        "i": entry("I64", [2], [13, 29]),
        "e": entry("F64", [0], [29, 29]),
    }
    raw = json.dumps(header).encode() + b" "  # odd length on purpose
    assert len(raw) % 8
    body = body_of(raw, b"\x07" + raw_bytes(floats) + raw_bytes(ints))
    layout, out = decode(body)
    assert layout.names() == ["b", "f", "i", "e"]
    assert out["b"].tolist() == [7]
    assert raw_bytes(out["f"]) == raw_bytes(floats)
    assert out["i"].tolist() == ints.tolist()
    assert out["e"].shape == (0,) and out["e"].dtype == torch.float64


def test_decode_accepts_entries_listed_out_of_payload_order() -> None:
    # JSON object order carries no meaning: the layout follows data_offsets.
    header = {
        "z": entry("U8", [0], [12, 12]),
        "last": entry("I16", [2], [8, 12]),
        "first": entry("F32", [2], [0, 8]),
    }
    payload = raw_bytes(torch.tensor([0.5, 2.0])) + raw_bytes(
        torch.tensor([-3, 4], dtype=torch.int16)
    )
    layout, out = decode(body_of(header, payload))
    assert layout.names() == ["first", "last", "z"]
    assert layout.offsets == ((0, 8), (8, 12), (12, 12))
    assert out["first"].tolist() == [0.5, 2.0] and out["last"].tolist() == [-3, 4]


def test_decoded_tensors_are_views_of_one_payload() -> None:
    tensors = {"a": torch.randn(3, 4), "b": torch.randn(5).bfloat16(), "c": torch.arange(4)}
    _, out = decode(encode(tensors))
    bases = {t.untyped_storage().data_ptr() for t in out.values()}
    assert len(bases) == 1  # aligned tensors are not copied out of the payload


# --- 3. malformed bodies ----------------------------------------------------------------------


def _valid_body() -> bytes:
    return encode(
        {
            "w": torch.arange(6, dtype=torch.float32).reshape(2, 3),
            "h": torch.tensor([1.0, -1.0], dtype=torch.bfloat16),
            "n": torch.tensor([3], dtype=torch.int64),
            "z": torch.empty(0, 2, dtype=torch.uint8),
        },
        {"round": "4"},
    )


def test_every_cut_point_is_truncated() -> None:
    body = _valid_body()
    for cut in range(len(body)):
        with pytest.raises(WireError) as exc:
            decode(body[:cut])
        assert exc.value.code == "truncated", cut
        assert exc.value.status == 400


@FAST
@given(tensors=NONEMPTY_TENSOR_DICTS, metadata=METADATA, data=st.data())
def test_truncated_bodies_raise_truncated(
    tensors: dict[str, torch.Tensor], metadata: dict[str, str], data: st.DataObject
) -> None:
    body = encode(tensors, metadata)
    cut = data.draw(st.integers(0, len(body) - 1), label="cut")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    for reader in all_readers(seed, 3):
        with pytest.raises(WireError) as exc:
            reader(body[:cut])
        assert exc.value.code == "truncated"


@pytest.mark.parametrize("extra", [b"\x00", b"tail", b" " * 100])
def test_trailing_bytes_are_rejected(extra: bytes) -> None:
    body = _valid_body() + extra
    for reader in all_readers(1, 4):
        with pytest.raises(WireError) as exc:
            reader(body)
        assert exc.value.code == "trailing_bytes" and exc.value.status == 400


def test_trailing_bytes_after_an_empty_payload_are_rejected() -> None:
    with pytest.raises(WireError) as exc:
        decode(encode({}) + b"x")
    assert exc.value.code == "trailing_bytes"


def test_header_over_the_limit_is_413_before_reading_it() -> None:
    # Only the prefix is present: the length alone must be enough to refuse the body.
    prefix = struct.pack("<Q", 65)
    for reader in (
        lambda: decode(prefix, max_header=64),
        lambda: read_layout(piecewise(prefix, random.Random(0)), 64),
        lambda: asyncio.run(aread_layout(PiecewiseStream(prefix, random.Random(0)), 64)),
    ):
        with pytest.raises(WireError) as exc:
            reader()
        assert exc.value.code == "header_too_large"
        assert exc.value.status == 413
        assert "65" in exc.value.detail and "64" in exc.value.detail


def test_header_length_limits() -> None:
    with pytest.raises(WireError) as exc:  # the default limit
        decode(struct.pack("<Q", 2**64 - 1))
    assert exc.value.code == "header_too_large" and exc.value.status == 413
    # A header of exactly the limit is accepted.
    raw = b"{}" + b" " * 62
    layout, out = decode(body_of(raw), max_header=64)
    assert out == {} and layout.total_size == 72
    for n in (0, 1):
        with pytest.raises(WireError) as exc:
            decode(struct.pack("<Q", n) + b"{}"[:n])
        assert exc.value.code == "bad_header" and exc.value.status == 400


F32_2 = entry("F32", [2], [0, 8])

MALFORMED: list[tuple[str, bytes, str]] = [
    # not JSON, not an object, not UTF-8
    ("not-json", body_of(b"{not json"), "bad_header"),
    ("json-then-junk", body_of(b"{} x"), "bad_header"),
    ("only-spaces", body_of(b"        "), "bad_header"),
    ("array", body_of([]), "bad_header"),
    ("number", body_of(1), "bad_header"),
    ("string", body_of("x"), "bad_header"),
    ("null", body_of(None), "bad_header"),
    ("true", body_of(True), "bad_header"),
    ("bad-utf8", body_of(b'{"\xff\xfe": 1}'), "bad_header"),
    ("utf8-surrogate", body_of(b'{"\xed\xa0\x80": 1}'), "bad_header"),
    ("truncated-utf8", body_of(b'{"a\xc3": 1}'), "bad_header"),
    ("utf8-bom", body_of(b"\xef\xbb\xbf{}"), "bad_header"),
    # entries
    ("entry-number", body_of({"a": 1}), "bad_header"),
    ("entry-list", body_of({"a": []}), "bad_header"),
    ("entry-missing-key", body_of({"a": {"dtype": "F32", "shape": [2]}}), "bad_header"),
    ("entry-extra-key", body_of({"a": {**F32_2, "x": 1}}), "bad_header"),
    # dtypes
    ("dtype-unknown", body_of({"a": entry("F8", [2], [0, 2])}, bytes(2)), "bad_dtype"),
    ("dtype-lowercase", body_of({"a": entry("f32", [2], [0, 8])}, bytes(8)), "bad_dtype"),
    ("dtype-empty", body_of({"a": entry("", [2], [0, 8])}, bytes(8)), "bad_dtype"),
    ("dtype-number", body_of({"a": entry(4, [2], [0, 8])}, bytes(8)), "bad_dtype"),
    ("dtype-null", body_of({"a": entry(None, [2], [0, 8])}, bytes(8)), "bad_dtype"),
    ("dtype-complex", body_of({"a": entry("C64", [1], [0, 8])}, bytes(8)), "bad_dtype"),
    # shapes
    ("shape-string", body_of({"a": entry("F32", "2", [0, 8])}, bytes(8)), "bad_header"),
    ("shape-number", body_of({"a": entry("F32", 2, [0, 8])}, bytes(8)), "bad_header"),
    ("shape-null", body_of({"a": entry("F32", None, [0, 8])}, bytes(8)), "bad_header"),
    ("shape-float", body_of({"a": entry("F32", [2.0], [0, 8])}, bytes(8)), "bad_header"),
    ("shape-fraction", body_of({"a": entry("F32", [1.5], [0, 6])}, bytes(6)), "bad_header"),
    ("shape-str-dim", body_of({"a": entry("F32", ["2"], [0, 8])}, bytes(8)), "bad_header"),
    ("shape-bool-dim", body_of({"a": entry("F32", [True, 2], [0, 8])}, bytes(8)), "bad_header"),
    ("shape-negative", body_of({"a": entry("F32", [-2], [0, 0])}), "bad_header"),
    ("shape-two-negatives", body_of({"a": entry("F32", [-1, -2], [0, 8])}, bytes(8)), "bad_header"),
    ("shape-nested", body_of({"a": entry("F32", [[2]], [0, 8])}, bytes(8)), "bad_header"),
    ("shape-null-dim", body_of({"a": entry("F32", [None], [0, 8])}, bytes(8)), "bad_header"),
    # data_offsets
    ("offsets-not-list", body_of({"a": entry("F32", [2], "0,8")}, bytes(8)), "bad_header"),
    ("offsets-one", body_of({"a": entry("F32", [2], [8])}, bytes(8)), "bad_header"),
    ("offsets-three", body_of({"a": entry("F32", [2], [0, 8, 8])}, bytes(8)), "bad_header"),
    ("offsets-negative", body_of({"a": entry("F32", [2], [-8, 0])}), "bad_header"),
    ("offsets-float", body_of({"a": entry("F32", [2], [0.0, 8.0])}, bytes(8)), "bad_header"),
    ("offsets-bool", body_of({"a": entry("U8", [1], [False, True])}, bytes(1)), "bad_header"),
    ("offsets-reversed", body_of({"a": entry("F32", [2], [8, 0])}, bytes(8)), "bad_header"),
    ("offsets-too-short", body_of({"a": entry("F32", [2], [0, 4])}, bytes(4)), "bad_header"),
    ("offsets-too-long", body_of({"a": entry("F32", [2], [0, 12])}, bytes(12)), "bad_header"),
    ("offsets-itemsize", body_of({"a": entry("BF16", [2], [0, 8])}, bytes(8)), "bad_header"),
    ("offsets-zero-size", body_of({"a": entry("F32", [0, 3], [0, 4])}, bytes(4)), "bad_header"),
    # tiling of the payload
    ("not-from-zero", body_of({"a": entry("F32", [2], [4, 12])}, bytes(12)), "bad_header"),
    (
        "gap",
        body_of({"a": entry("F32", [1], [0, 4]), "b": entry("F32", [1], [8, 12])}, bytes(12)),
        "bad_header",
    ),
    (
        "overlap",
        body_of({"a": entry("F32", [2], [0, 8]), "b": entry("F32", [2], [4, 12])}, bytes(12)),
        "bad_header",
    ),
    (
        "same-range",
        body_of({"a": entry("F32", [1], [0, 4]), "b": entry("I32", [1], [0, 4])}, bytes(4)),
        "bad_header",
    ),
    (
        "contained",
        body_of({"a": entry("U8", [8], [0, 8]), "b": entry("U8", [2], [2, 4])}, bytes(8)),
        "bad_header",
    ),
    (
        "zero-size-past-end",
        body_of({"a": entry("U8", [4], [0, 4]), "z": entry("F32", [0], [8, 8])}, bytes(8)),
        "bad_header",
    ),
    # metadata
    ("meta-int-value", body_of({"__metadata__": {"k": 1}}), "bad_header"),
    ("meta-null-value", body_of({"__metadata__": {"k": None}}), "bad_header"),
    ("meta-list-value", body_of({"__metadata__": {"k": ["v"]}}), "bad_header"),
    ("meta-dict-value", body_of({"__metadata__": {"k": {"v": "w"}}}), "bad_header"),
    ("meta-list", body_of({"__metadata__": ["k", "v"]}), "bad_header"),
    ("meta-string", body_of({"__metadata__": "k=v"}), "bad_header"),
    ("meta-null", body_of({"__metadata__": None}), "bad_header"),
    ("meta-number", body_of({"__metadata__": 3}), "bad_header"),
    # the payload itself
    ("payload-short", body_of({"a": F32_2}, bytes(7)), "truncated"),
    ("payload-missing", body_of({"a": F32_2}), "truncated"),
    ("payload-long", body_of({"a": F32_2}, bytes(9)), "trailing_bytes"),
    ("payload-without-tensors", body_of({}, b"\x00"), "trailing_bytes"),
]


@pytest.mark.parametrize(("body", "code"), [pytest.param(b, c, id=i) for i, b, c in MALFORMED])
def test_malformed_bodies_raise_wire_error(body: bytes, code: str) -> None:
    for reader in all_readers(3, 2):
        with pytest.raises(WireError) as exc:
            reader(body)
        assert exc.value.code == code
        assert exc.value.status == 400
        assert exc.value.detail


def test_errors_name_the_offending_tensor() -> None:
    with pytest.raises(WireError, match="'bias'"):
        decode(body_of({"bias": entry("F32", [2], [0, 4])}, bytes(4)))
    with pytest.raises(WireError, match="'bias'"):
        decode(body_of({"bias": entry("F8", [2], [0, 2])}, bytes(2)))
    with pytest.raises(WireError, match="'late'"):
        decode(body_of({"late": entry("F32", [1], [4, 8])}, bytes(8)))


# Inputs that once escaped as exceptions other than WireError (which the server would have
# answered with 500 instead of 400).


@pytest.mark.parametrize("dtype", [[], {}, ["F32"]])
def test_unhashable_dtype_is_a_wire_error(dtype: object) -> None:
    with pytest.raises(WireError):
        decode(body_of({"a": entry(dtype, [2], [0, 8])}, bytes(8)))


def test_integer_with_too_many_digits_is_a_wire_error() -> None:
    with pytest.raises(WireError):
        decode(
            body_of(
                b'{"a": {"dtype": "U8", "shape": [' + b"9" * 5000 + b'], "data_offsets": [0, 0]}}'
            )
        )


def test_deeply_nested_header_is_a_wire_error() -> None:
    depth = 200_000
    with pytest.raises(WireError):
        decode(body_of(b'{"__metadata__": ' + b"[" * depth + b"]" * depth + b"}"))


@pytest.mark.parametrize("size", [2**62, 2**70])
def test_impossible_declared_size_is_a_wire_error(size: int) -> None:
    with pytest.raises(WireError):
        decode(body_of({"a": entry("U8", [size], [0, size])}))


# --- fuzzing ----------------------------------------------------------------------------------


@FUZZ
@given(data=st.binary(max_size=300))
def test_arbitrary_bytes_decode_or_raise_wire_error(data: bytes) -> None:
    decode_or_wire_error(data)


@FUZZ
@given(header=st.binary(max_size=200), payload=st.binary(max_size=32))
def test_arbitrary_header_bytes_decode_or_raise_wire_error(header: bytes, payload: bytes) -> None:
    decode_or_wire_error(body_of(header, payload))
    decode_or_wire_error(body_of(header, payload), max_header=len(header) // 2 + 2)


@FUZZ
@given(
    body=st.just(_valid_body()),
    edits=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=3),
    cut=st.integers(0, 8),
)
def test_mutated_valid_bodies_decode_or_raise_wire_error(
    body: bytes, edits: list[tuple[int, int]], cut: int
) -> None:
    mutated = bytearray(body)
    for where, value in edits:
        mutated[where % len(mutated)] = value
    decode_or_wire_error(bytes(mutated))
    decode_or_wire_error(bytes(mutated[: len(mutated) - cut]))


# Structured JSON headers: plausible entries with wrong parts.
SMALL_INTS = st.integers(-2, 12)
JSON_SCALARS = (
    st.none()
    | st.booleans()
    | SMALL_INTS
    | st.floats(allow_nan=False, allow_infinity=False, width=32)
    | st.text(max_size=4)
)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda kids: (
        st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=4), kids, max_size=3)
    ),
    max_leaves=8,
)


def mostly(good: st.SearchStrategy, bad: st.SearchStrategy) -> st.SearchStrategy:
    """``good`` three times in four, else ``bad``."""
    return st.integers(0, 3).flatmap(lambda k: good if k else bad)


ENTRIES = st.fixed_dictionaries(
    {
        "dtype": mostly(st.sampled_from(list(DTYPE_CODES)), st.sampled_from(["F8", "", None, 4])),
        "shape": mostly(st.lists(st.integers(0, 3), max_size=3), JSON_VALUES),
        "data_offsets": mostly(st.lists(st.integers(0, 40), min_size=2, max_size=2), JSON_VALUES),
    }
)


@st.composite
def fuzz_bodies(draw: st.DrawFn) -> bytes:
    header: dict[str, object] = draw(
        st.dictionaries(NAMES, mostly(ENTRIES, JSON_VALUES), max_size=3)
    )
    if draw(st.booleans()):
        header["__metadata__"] = draw(
            st.dictionaries(st.text(max_size=4), st.text(max_size=4), max_size=2) | JSON_VALUES
        )
    pos = 0
    # Usually, give the tensors a tiling that could be valid.
    if draw(mostly(st.just(True), st.just(False))):
        for value in header.values():
            if isinstance(value, dict) and isinstance(value.get("shape"), list):
                size = math.prod(d for d in value["shape"] if isinstance(d, int))
                code = value.get("dtype")
                dtype = DTYPE_CODES.get(code) if isinstance(code, str) else None
                right = torch.empty((), dtype=dtype).element_size() if dtype else 1
                end = pos + size * draw(mostly(st.just(right), st.sampled_from([1, 2, 4, 8])))
                value["data_offsets"] = [pos, end]
                pos = end
    length = max(0, pos + draw(mostly(st.just(0), st.sampled_from([-1, 1, 5]))))
    payload = draw(mostly(st.binary(min_size=length, max_size=length), st.binary(max_size=48)))
    return body_of(header, payload)


@FUZZ
@given(body=fuzz_bodies())
def test_fuzzed_json_headers_decode_or_raise_wire_error(body: bytes) -> None:
    decode_or_wire_error(body)


# --- 4. check_against -------------------------------------------------------------------------

TABLE = {"w": (3, 4), "b": (4,), "s": ()}


def _layout(tensors: Mapping[str, torch.Tensor]) -> Layout:
    return decode(encode(tensors))[0]


def _good() -> dict[str, torch.Tensor]:
    return {"w": torch.zeros(3, 4), "b": torch.zeros(4), "s": torch.zeros(())}


def test_check_against_accepts_a_matching_body() -> None:
    check_against(_layout(_good()), TABLE, ["F32"])
    bf16 = {n: t.bfloat16() for n, t in _good().items()}
    check_against(_layout(bf16), TABLE, ("F32", "BF16"))
    check_against(_layout({"b": torch.zeros(4)}), TABLE, ["F32"], require_all=False)
    check_against(_layout({}), {}, ["F32"])


def test_check_against_unknown_tensor() -> None:
    tensors = {**_good(), "extra": torch.zeros(4)}
    with pytest.raises(WireError) as exc:
        check_against(_layout(tensors), TABLE, ["F32"])
    assert exc.value.code == "unknown_tensor" and exc.value.status == 400
    assert "'extra'" in exc.value.detail


def test_check_against_renamed_tensor() -> None:
    tensors = _good()
    tensors["W"] = tensors.pop("w")
    with pytest.raises(WireError) as exc:
        check_against(_layout(tensors), TABLE, ["F32"])
    assert exc.value.code == "unknown_tensor"
    assert "'W'" in exc.value.detail


@pytest.mark.parametrize("shape", [(4, 3), (12,), (3, 4, 1), (), (0, 4)])
def test_check_against_shape_mismatch(shape: tuple[int, ...]) -> None:
    tensors = {**_good(), "w": torch.zeros(shape)}
    with pytest.raises(WireError) as exc:
        check_against(_layout(tensors), TABLE, ["F32"])
    assert exc.value.code == "shape_mismatch" and exc.value.status == 400
    assert "'w'" in exc.value.detail
    assert "[3, 4]" in exc.value.detail  # the expected shape
    assert str(list(shape)) in exc.value.detail  # and the one received


def test_check_against_dtype_mismatch() -> None:
    tensors = {**_good(), "b": torch.zeros(4, dtype=torch.float16)}
    with pytest.raises(WireError) as exc:
        check_against(_layout(tensors), TABLE, ["F32", "BF16"])
    assert exc.value.code == "dtype_mismatch" and exc.value.status == 400
    assert "'b'" in exc.value.detail and "F16" in exc.value.detail
    with pytest.raises(WireError) as exc:
        check_against(_layout(_good()), TABLE, ["BF16"])
    assert exc.value.code == "dtype_mismatch"


def test_check_against_missing_tensor() -> None:
    tensors = _good()
    del tensors["b"]
    with pytest.raises(WireError) as exc:
        check_against(_layout(tensors), TABLE, ["F32"])
    assert exc.value.code == "missing_tensor" and exc.value.status == 400
    assert "'b'" in exc.value.detail
    with pytest.raises(WireError) as exc:
        check_against(_layout({}), TABLE, ["F32"])
    assert exc.value.code == "missing_tensor"


@FAST
@given(tensors=TENSOR_DICTS)
def test_check_against_accepts_its_own_table(tensors: dict[str, torch.Tensor]) -> None:
    layout = _layout(tensors)
    table = {n: tuple(t.shape) for n, t in tensors.items()}
    check_against(layout, table, {spec_of(n, t).dtype for n, t in tensors.items()})


# --- 5. zero-copy byte views ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
def test_byte_view_shares_memory(dtype: torch.dtype) -> None:
    t = torch.arange(6).to(dtype).reshape(2, 3)
    view = byte_view(t)
    assert len(view) == t.numel() * t.element_size()
    assert view.format == "B" and view.ndim == 1
    assert np.frombuffer(view, dtype=np.uint8).ctypes.data == t.data_ptr()
    assert bytes(view) == raw_bytes(t)
    t[1, 2] = 100  # mutating the tensor shows through the view
    assert bytes(view) == raw_bytes(t)
    expected = torch.tensor([100], dtype=dtype)
    item = t.element_size()
    assert bytes(view[5 * item : 6 * item]) == raw_bytes(expected)
    view[0:item] = raw_bytes(torch.tensor([7], dtype=dtype))  # and the other way round
    assert t[0, 0].item() == 7


def test_byte_view_of_bf16_is_its_bit_pattern() -> None:
    t = torch.tensor([1.0, -2.0], dtype=torch.bfloat16)
    view = byte_view(t)
    assert bytes(view) == b"\x80\x3f\x00\xc0"  # 0x3f80, 0xc000 little-endian
    t[0] = float("inf")
    assert bytes(view[:2]) == b"\x80\x7f"


def test_byte_view_of_a_contiguous_slice_starts_at_its_offset() -> None:
    base = torch.arange(10, dtype=torch.float32)
    part = base[3:7]
    view = byte_view(part)
    assert np.frombuffer(view, dtype=np.uint8).ctypes.data == part.data_ptr()
    base[4] = -1
    assert bytes(view[4:8]) == raw_bytes(torch.tensor([-1.0]))


def test_byte_view_edge_cases() -> None:
    assert len(byte_view(torch.empty(0, 3))) == 0
    assert bytes(byte_view(torch.tensor(1.0))) == struct.pack("<f", 1.0)
    with pytest.raises(ValueError):
        byte_view(torch.zeros(3, 4).t())


class ChunkStream:
    """aiohttp's ``readany``: chunks as they came off the socket, whatever size was wanted."""

    def __init__(self, data: bytes, cuts: list[int]) -> None:
        bounds = sorted({c for c in cuts if 0 < c < len(data)})
        edges = [0, *bounds, len(data)]
        self._chunks = [data[a:b] for a, b in zip(edges, edges[1:], strict=False) if b > a]

    async def readany(self) -> bytes:
        await asyncio.sleep(0)
        return self._chunks.pop(0) if self._chunks else b""

    async def read(self, n: int = -1) -> bytes:
        return await self.readany()


@given(
    data=st.binary(min_size=1, max_size=200),
    cuts=st.lists(st.integers(0, 200), max_size=12),
    stretches=st.lists(st.integers(1, 40), min_size=1, max_size=12),
    extra=st.binary(max_size=5),
)
@settings(max_examples=150, deadline=None)
def test_payload_reader_fills_stretches_across_chunk_edges(
    data: bytes, cuts: list[int], stretches: list[int], extra: bytes
) -> None:
    """Chunks that straddle two stretches are split between them, the bytes arrive in order, and
    a body longer than its payload is refused at the end."""
    sizes: list[int] = []
    left = len(data)
    for s in stretches:
        if left == 0:
            break
        sizes.append(min(s, left))
        left -= sizes[-1]
    if left:
        sizes.append(left)

    async def scenario() -> bytes:
        reader = PayloadReader(ChunkStream(data + extra, cuts))
        got = b""
        for size in sizes:
            dest = bytearray(size)
            await reader.fill(memoryview(dest))
            got += bytes(dest)
        if extra:
            with pytest.raises(WireError) as err:
                await reader.end()
            assert err.value.code == "trailing_bytes"
        else:
            await reader.end()
        return got

    assert asyncio.run(scenario()) == data


def test_payload_reader_says_how_much_was_missing() -> None:
    async def scenario() -> None:
        reader = PayloadReader(ChunkStream(b"abcdef", [2]))
        await reader.fill(memoryview(bytearray(4)))
        with pytest.raises(WireError) as err:
            await reader.fill(memoryview(bytearray(5)))
        assert err.value.code == "truncated" and "3 bytes early" in str(err.value)

    asyncio.run(scenario())
