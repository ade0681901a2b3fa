"""The server's reading of a codec upload (server/intake/upload_body.py) and the running sum's
encoded entries (core/accumulate.py): the add decodes a chunk at a time, never a whole upload
(measured with the profiler's allocation records), frees the receive buffer in payload order, and
lands the same bits as decoding first."""

from __future__ import annotations

import struct
from collections.abc import Callable, Mapping

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from diloco.core.accumulate import WeightedSum
from diloco.core.codecs import CHUNK, Encoded, codec_by_name, codec_metadata, encode_named
from diloco.server.errors import ApiError
from diloco.server.intake.upload_body import UploadBody
from diloco.wire import Layout, WireError, encode, tensor_views
from diloco.wire.layout import parse_header
from tests.helpers.codecs import in_order

BIG = {"w": (2048, 1536), "b": (1536,)}  # w: 3M elements, 12 MiB in fp32
CODECS = [("int8", {}), ("int4", {}), ("lowrank", {"rank": 4}), ("topk", {"density": 0.0156})]


def grads(shapes: Mapping[str, tuple[int, ...]], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in shapes.items()}


def landed(data: bytes) -> tuple[Layout, dict[str, torch.Tensor]]:
    (n,) = struct.unpack("<Q", data[:8])
    layout = parse_header(data[8 : 8 + n])
    payload = torch.frombuffer(bytearray(data[8 + n :]), dtype=torch.uint8)
    return layout, tensor_views(layout, payload)


def _decode(entry: object) -> torch.Tensor:
    assert isinstance(entry, Encoded)
    return entry.decode()


def largest_allocation(fn: Callable[[], None]) -> int:
    """Bytes of the largest single CPU allocation made while ``fn`` runs."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max((e.self_cpu_memory_usage for e in prof.events()), default=0)


@pytest.mark.parametrize(("name", "options"), CODECS)
def test_the_add_allocates_no_full_size_temporary(name: str, options: dict[str, object]) -> None:
    codec = codec_by_name(name, **options)
    wire = encode_named(codec, grads(BIG, 1))
    layout, views = landed(encode(wire, codec_metadata(codec)))
    body = UploadBody.read(layout, BIG, [name])
    assert not body.plain
    entries = body.entries(views, BIG)
    wsum = WeightedSum(list(BIG.values()))
    wsum.add([torch.zeros(s) for s in BIG.values()], 1.0)  # a contribution counts already
    reports: list[int] = []
    add = body.add(wsum, layout, list(BIG), entries, 0.5, reports.append)
    full = 4 * 2048 * 1536
    assert largest_allocation(add) < full // 2
    assert reports and reports[-1] == layout.payload_size
    # The measure would see a whole decode: the test is not blind to it.
    decoded: list[torch.Tensor] = []
    assert largest_allocation(lambda: decoded.extend(_decode(e) for e in entries)) >= full
    for acc, d in zip(wsum.sums, decoded, strict=True):  # same bits as decoding first
        assert torch.equal(acc, torch.zeros_like(d).add_(d, alpha=0.5))


@pytest.mark.parametrize(("name", "options"), CODECS)
def test_the_receive_buffer_is_freed_in_payload_order(
    name: str, options: dict[str, object]
) -> None:
    shapes = {"a": (64, 48), "b": (3 * CHUNK // 2,), "c": (100, 30)}
    codec = codec_by_name(name, **options)
    wire = encode_named(codec, grads(shapes, 2))
    for data in (encode(wire, codec_metadata(codec)), in_order(wire, codec_metadata(codec))):
        layout, views = landed(data)
        body = UploadBody.read(layout, shapes, [name])
        entries = body.entries(views, shapes)
        reports: list[int] = []
        wsum = WeightedSum(list(shapes.values()))
        body.add(wsum, layout, list(shapes), entries, 1.0, reports.append)()
        assert reports == sorted(reports) and reports[-1] == layout.payload_size
        want = [e.decode() for e in entries if isinstance(e, Encoded)]
        assert all(torch.equal(a, b) for a, b in zip(wsum.sums, want, strict=True))
    # With each tensor's parts together, the buffer frees tensor by tensor, before the end.
    assert len(set(reports)) == len(shapes) and reports[0] < layout.payload_size


def test_weighted_sum_counts_encoded_entries_like_plain_ones() -> None:
    codec = codec_by_name("int4")
    shapes = {"x": (5, 7), "y": (9000,)}
    g1, g2 = grads(shapes, 3), grads(shapes, 4)
    e1 = [Encoded.of(codec, codec.encode(t), t.shape) for t in g1.values()]
    e2 = [Encoded.of(codec, codec.encode(t), t.shape) for t in g2.values()]
    d1, d2 = [e.decode() for e in e1], [e.decode() for e in e2]
    wsum, plain = WeightedSum(list(shapes.values())), WeightedSum(list(shapes.values()))
    pieces: list[tuple[int, int]] = []
    wsum.add(e1, 2.0, on_piece=lambda i, end: pieces.append((i, end)))
    wsum.add(e2, 0.5, order=[1, 0])
    plain.add(d1, 2.0)
    plain.add(d2, 0.5)
    assert pieces == [(0, 35), (1, 9000)]
    assert (wsum.count, wsum.total_weight) == (plain.count, plain.total_weight) == (2, 2.5)
    assert all(torch.equal(a, b) for a, b in zip(wsum.sums, plain.sums, strict=True))
    with pytest.raises(ValueError, match="shape"):
        wsum.add(list(reversed(e1)), 1.0)


def test_read_names_the_tensor_and_the_expected_part() -> None:
    codec = codec_by_name("int8")
    shapes = {"w": (3, 4), "b": (4,)}
    wire = encode_named(codec, grads(shapes, 5))
    wire["w@scale"] = torch.zeros(2, dtype=torch.bfloat16)
    layout, _ = landed(encode(wire, codec_metadata(codec)))
    with pytest.raises(ApiError, match=r"parameter 'w': part '@scale'.*\(1,\), got \(2,\)"):
        UploadBody.read(layout, shapes, ["int8"])
    wire.pop("w@scale")
    layout, _ = landed(encode(wire, codec_metadata(codec)))
    with pytest.raises(WireError, match="'w@scale'"):
        UploadBody.read(layout, shapes, ["int8"])
    raw, _ = landed(encode(grads(shapes, 5), {"codec": "raw"}))
    body = UploadBody.read(raw, shapes, ["fp32"])
    assert (body.codec, body.name, body.plain) == (None, "fp32", True)
    with pytest.raises(ApiError, match="does not take fp32"):
        UploadBody.read(raw, shapes, ["int8"])
