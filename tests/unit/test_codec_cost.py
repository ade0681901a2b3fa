"""What made lossy rounds cheaper (issue 30 item 5) keeps every bit: top-k's two-stage selection
picks a top k, a reused ``Workspace`` gives the bits of fresh scratch, a counted upload commits
from the parts it sent (no second encoding) with the residual of encoding again, and the
checksum computed beside the work is the checksum of the finished buffer."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch

from diloco.core.codecs import BlockCodec, Workspace
from diloco.core.codecs.downlink import apply_update, encode_update
from diloco.core.codecs.topk import group_size, top_positions
from diloco.core.pseudo_gradient import PIECE
from diloco.wire.checksum import checksum, checksum_behind
from diloco.worker.settings import parse_codec
from diloco.worker.state.encoder import Upload, UploadEncoder, comm_dtype
from diloco.worker.state.local_model import LocalModel
from tests.helpers.codecs import make_model

# --- top-k selection ------------------------------------------------------------------------


def _mags(rows: int, length: int, seed: int) -> torch.Tensor:
    x = torch.randn(rows, length, generator=torch.Generator().manual_seed(seed))
    return torch.bitwise_and(x.view(torch.int32), 0x7FFFFFFF)


@pytest.mark.parametrize(
    ("length", "k"), [(4096, 64), (4096, 1), (1024, 16), (65536, 1022), (4096, 4096), (96, 3)]
)
def test_top_positions_are_the_k_largest(length: int, k: int) -> None:
    mag = _mags(5, length, seed=length + k)
    got = top_positions(mag, k).sort(dim=1).values
    want = torch.topk(mag, k, dim=1).indices.sort(dim=1).values
    assert torch.equal(got, want)


def test_the_groups_are_about_sqrt_length_over_k() -> None:
    assert group_size(4096, 64) == 8  # 512 group maxima, 512 candidates
    assert group_size(4096, 1) == 64
    assert group_size(4096, 4096) == 1  # keeps everything: one plain topk
    assert group_size(100, 2) == 4  # a short last chunk: groups must divide it
    assert group_size(99, 2) == 1


def test_with_ties_the_positions_are_a_top_k_and_the_same_every_time() -> None:
    """Rows of few distinct values: k distinct positions, none smaller than any left out."""
    gen = torch.Generator().manual_seed(3)
    rows = torch.randint(0, 3, (6, 4096), generator=gen, dtype=torch.int32)
    rows[0] = 0  # an all-zero chunk
    rows[1, ::7] = 5  # more maxima than k
    for k in (1, 64, 700):
        pos = top_positions(rows, k)
        assert torch.equal(pos, top_positions(rows, k))
        assert all(len(set(r.tolist())) == k for r in pos)
        kept = torch.zeros_like(rows, dtype=torch.bool).scatter_(1, pos, True)
        for r in range(rows.shape[0]):
            assert int(rows[r][kept[r]].min()) >= int(rows[r][~kept[r]].max())


# --- the workspace ----------------------------------------------------------------------------


def test_a_workspace_hands_back_the_same_memory_and_grows() -> None:
    work = Workspace()
    cpu = torch.device("cpu")
    a = work.get("x", torch.float32, 100, cpu)
    assert work.get("x", torch.float32, 50, cpu).data_ptr() == a.data_ptr()
    assert work.get("y", torch.float32, 50, cpu).data_ptr() != a.data_ptr()
    assert work.get("x", torch.int8, 50, cpu).data_ptr() != a.data_ptr()
    big = work.get("x", torch.float32, 1000, cpu)
    assert big.numel() == 1000 and work.get("x", torch.float32, 10, cpu).numel() == 10


CODECS = ["bf16", "int8", "int4", "int4:block=32", "topk", "topk:density=0.1,chunk=256,bits=4"]


@pytest.mark.parametrize("spec", CODECS)
def test_reused_scratch_gives_the_bits_of_fresh_scratch(spec: str) -> None:
    """Calls of several sizes through one workspace (stale contents, larger buffers than the
    call needs) against each call on its own fresh scratch."""
    codec = parse_codec(spec)
    assert isinstance(codec, BlockCodec)
    work = Workspace()
    gen = torch.Generator().manual_seed(7)
    for n in ((1 << 20) + 4096, 12_288, (1 << 20) + 100, 8192):
        x = torch.randn(n, generator=gen)
        fresh = codec.encode_piece(x)
        reused = codec.encode_piece(x, None, work)
        assert all(torch.equal(a, b) for a, b in zip(fresh, reused, strict=True))
        acc = torch.randn(n, generator=gen)
        want, got = acc.clone(), acc.clone()
        codec.add_piece_into(want, fresh, 0.25, False)
        codec.add_piece_into(got, fresh, 0.25, False, work)
        assert torch.equal(want, got)
        codec.add_piece_into(want, fresh, -1.0, True)
        codec.add_piece_into(got, fresh, -1.0, True, work)
        assert torch.equal(want, got)


@pytest.mark.parametrize("spec", ["bf16", "int8", "int4"])
def test_the_downlink_with_a_workspace_keeps_replicas_bit_identical(spec: str) -> None:
    codec = parse_codec(spec)
    assert isinstance(codec, BlockCodec)
    gen = torch.Generator().manual_seed(8)
    published = torch.randn((1 << 20) + 8192, generator=gen)
    true = published + 1e-3 * torch.randn(published.shape, generator=gen)
    server, replica, plain = published.clone(), published.clone(), published.clone()
    work, other = Workspace(), Workspace()
    for _ in range(2):  # the second round reuses stale scratch
        parts = encode_update(codec, true, server, None, work)
        assert all(
            torch.equal(a, b) for a, b in zip(parts, encode_update(codec, true, plain), strict=True)
        )
        apply_update(codec, replica, parts, other)
        assert torch.equal(replica, server) and torch.equal(server, plain)
        true = true + 1e-3


# --- the commit from the parts sent ------------------------------------------------------------


def _encoder(spec: str) -> tuple[LocalModel, UploadEncoder]:
    model = make_model()
    local = LocalModel(model, comm_dtype(parse_codec(spec)), {})
    gen = torch.Generator().manual_seed(1)
    local.snapshot = {
        n: p.detach() + torch.randn(p.shape, generator=gen) for n, p in local.params.items()
    }
    return local, UploadEncoder(parse_codec(spec), local, {"residual_norm": 0.0})


def _bytes(up: Upload) -> list[bytes]:
    out = []
    for spec in up.specs:
        t = up.produce(spec)
        assert isinstance(t, torch.Tensor)  # a lossy body's parts come whole
        out.append(bytes(t.contiguous().view(torch.uint8).numpy()))
    return out


@pytest.mark.parametrize("spec", ["int8", "int4", "topk:density=0.1,chunk=64"])
def test_a_counted_upload_encodes_once_and_commits_the_bits_of_encoding_again(spec: str) -> None:
    """Two rounds (the second compensated by the first's residual): the kept parts give the
    residual that ``commit_flat`` computes by encoding ``c`` again, bit for bit, and neither a
    retry nor the commit calls the encoder."""
    local, enc = _encoder(spec)
    ref_local, ref = _encoder(spec)
    block = enc.codec
    assert isinstance(block, BlockCodec)
    calls = []
    plain_encode = block.encode_piece

    def counting(*a: object, **k: object) -> list[torch.Tensor]:
        calls.append(1)
        return plain_encode(*a, **k)  # type: ignore[arg-type]

    block.encode_piece = counting  # type: ignore[method-assign]
    for step in range(2):
        up = enc.model_upload()
        body = _bytes(up)
        encoded = len(calls)
        assert encoded == sum(-(-p.numel() // PIECE) for p in local.params.values())
        assert _bytes(up) == body and len(calls) == encoded  # a retry: same bytes, no encoding
        up.commit()
        assert len(calls) == encoded  # the commit subtracts what was sent
        calls.clear()
        assert ref.feedback is not None and enc.feedback is not None
        for name, p in ref_local.params.items():
            e = ref.residual(name).view(-1)
            for a, b, g in ref.pieces(name, p):
                ref.commit_flat(ref.codec, e[a:b], g)  # type: ignore[arg-type]
        for name, e in enc.feedback.residuals.items():
            assert torch.equal(e, ref.feedback.residuals[name]), (step, name)
        with torch.no_grad():  # the next round's progress, the same on both
            for p, q in zip(local.params.values(), ref_local.params.values(), strict=True):
                p.add_(0.01)
                q.add_(0.01)


# --- the checksum beside the work ---------------------------------------------------------------


def test_the_checksum_behind_the_work_is_the_checksum_of_the_whole_buffer() -> None:
    data = bytearray(torch.randint(0, 256, (100_003,), dtype=torch.uint8).numpy().tobytes())
    view = memoryview(data)
    ends = (0, 7, 4096, 4096, 50_000, 99_999)
    stretches = list(zip((0, *ends[:-1]), ends, strict=True))

    def work() -> Iterator[int]:  # finishes each stretch just before yielding its end
        for a, b in stretches:
            data[a:b] = bytes(reversed(data[a:b]))
            yield b

    want = bytearray(data)
    for a, b in stretches:
        want[a:b] = bytes(reversed(want[a:b]))
    assert checksum_behind(view, work()) == checksum([bytes(want)])


def test_the_checksum_behind_refuses_offsets_that_go_back_and_lets_errors_through() -> None:
    view = memoryview(bytearray(64))
    with pytest.raises(ValueError, match="offset 3 after 10"):
        checksum_behind(view, iter([10, 3]))
    with pytest.raises(ValueError, match="offset 65"):
        checksum_behind(view, iter([65]))

    def broken() -> Iterator[int]:
        yield 8
        raise RuntimeError("the apply failed")

    with pytest.raises(RuntimeError, match="the apply failed"):
        checksum_behind(view, broken())
    assert not [t for t in threading.enumerate() if t.name == "checksum"]
