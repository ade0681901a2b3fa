"""StreamedAdoption: the model takes a download's values as their bytes land, and only then."""

from __future__ import annotations

import pytest
import torch

from diloco.wire import WireError, build_layout, byte_view, readinto_payload, tensor_views
from diloco.wire.layout import TensorSpec
from diloco.worker.state.adoption import StreamedAdoption

SHAPES = {"a": (3, 5), "b": (7,), "c": (2, 2)}


def _download() -> tuple[object, torch.Tensor, dict[str, torch.Tensor]]:
    """A layout, its full payload, and an empty payload's views (the snapshot to fill)."""
    layout = build_layout([TensorSpec(n, "F32", s) for n, s in SHAPES.items()])
    source = torch.empty(layout.payload_size, dtype=torch.uint8)
    values = tensor_views(layout, source)
    for i, t in enumerate(values.values()):
        t.copy_(torch.arange(t.numel(), dtype=torch.float32).view(t.shape) + 100 * (i + 1))
    return layout, source, values


def _elements_in(layout, name: str, received: int) -> int:
    begin, end = dict(zip(layout.names(), layout.offsets, strict=True))[name]
    return max(0, min(received, end) - begin) // 4


@pytest.mark.parametrize("cuts", [[3, 4, 17, 61, 62, 99, 10**6], [10**6], [1, 2, 3, 10**6]])
def test_elements_are_adopted_as_soon_as_their_bytes_are_in_and_not_before(cuts) -> None:
    layout, source, values = _download()
    payload = torch.zeros_like(source)
    snapshot = tensor_views(layout, payload)
    params = {n: torch.full(s, -1.0) for n, s in SHAPES.items()}
    adoption = StreamedAdoption(layout, snapshot, params)
    received = 0
    for cut in cuts:
        cut = min(cut, layout.payload_size)
        payload[received:cut] = source[received:cut]  # the socket writes the next bytes
        received = cut
        adoption.upto(received)
        for name, p in params.items():
            k = _elements_in(layout, name, received)
            flat = p.view(-1)
            assert torch.equal(flat[:k], values[name].view(-1)[:k]), (name, received)
            assert bool((flat[k:] == -1.0).all()), f"{name}: adopted bytes not yet received"
    assert adoption.complete


def test_a_parameter_that_cannot_be_cut_is_adopted_whole_once_complete() -> None:
    layout, source, values = _download()
    payload = torch.zeros_like(source)
    snapshot = tensor_views(layout, payload)
    params = {n: torch.full(s, -1.0) for n, s in SHAPES.items()}
    params["a"] = torch.full((5, 3), -1.0).t()  # same shape, not contiguous
    adoption = StreamedAdoption(layout, snapshot, params)
    end_a = dict(zip(layout.names(), layout.offsets, strict=True))["a"][1]
    payload[: end_a - 1] = source[: end_a - 1]
    adoption.upto(end_a - 1)
    assert bool((params["a"] == -1.0).all())
    payload[end_a - 1 :] = source[end_a - 1 :]
    adoption.upto(layout.payload_size)
    assert adoption.complete
    for name, p in params.items():
        assert torch.equal(p, values[name])


def test_values_are_converted_to_the_parameter_dtype() -> None:
    layout, source, values = _download()
    params = {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in SHAPES.items()}
    adoption = StreamedAdoption(layout, tensor_views(layout, source.clone()), params)
    adoption.upto(layout.payload_size // 2)
    adoption.upto(layout.payload_size)
    for name, p in params.items():
        assert torch.equal(p, values[name].bfloat16())


def test_a_shape_mismatch_is_refused_before_anything_is_copied() -> None:
    layout, source, _ = _download()
    params = {n: torch.zeros(s) for n, s in SHAPES.items()}
    params["b"] = torch.zeros(8)
    with pytest.raises(ValueError, match="'b'"):
        StreamedAdoption(layout, tensor_views(layout, source), params)
    assert all(bool((p == 0).all()) for p in params.values())


class _Stream:
    """A body delivered in reads of at most ``sizes[i]`` bytes (then as asked), which breaks
    off after ``cut`` bytes when given."""

    def __init__(self, data: bytes, sizes: list[int], cut: int | None = None) -> None:
        self.data, self.sizes, self.pos = data, list(sizes), 0
        self.end = len(data) if cut is None else cut

    def readinto(self, view: memoryview) -> int:
        limit = self.sizes.pop(0) if self.sizes else len(view)
        n = min(len(view), limit, self.end - self.pos)
        view[:n] = self.data[self.pos : self.pos + n]
        self.pos += n
        return n

    def read(self, n: int) -> bytes:
        return b""


def test_progress_is_reported_in_slices_and_for_a_short_read_before_a_cut() -> None:
    data = bytes(range(256)) * 4  # 1024 bytes
    dest = bytearray(len(data))
    seen: list[int] = []
    readinto_payload(
        _Stream(data, [100]).readinto,
        lambda n: b"",
        memoryview(dest),
        seen.append,
        progress_bytes=300,
    )
    assert dest == data
    # No read spans a report: 100 (short), then slices of 300 from there, then the rest.
    assert seen == [100, 400, 700, 1000, 1024]

    seen.clear()
    with pytest.raises(WireError, match="734 bytes early"):
        readinto_payload(
            _Stream(data, [250], cut=290).readinto,
            lambda n: b"",
            memoryview(bytearray(len(data))),
            seen.append,
            progress_bytes=300,
        )
    assert seen == [250, 290]  # the short read before the cut is reported


def test_progress_reports_drive_an_adoption_to_the_end() -> None:
    layout, source, values = _download()
    payload = torch.zeros_like(source)
    params = {n: torch.zeros(s) for n, s in SHAPES.items()}
    adoption = StreamedAdoption(layout, tensor_views(layout, payload), params)
    stream = _Stream(bytes(byte_view(source)), [7, 13, 40, 5])
    readinto_payload(stream.readinto, lambda n: b"", byte_view(payload), adoption.upto, 16)
    assert adoption.complete
    for name, p in params.items():
        assert torch.equal(p, values[name])
