"""The worker's codec: how it is chosen (argument, DILOCO_CODEC, --codec, bf16_comm), refused,
and how ``UploadEncoder`` builds bodies and moves the residual (no server: a ``LocalModel`` with
a snapshot set by hand). Through a real server: tests/integration/test_worker_codecs.py."""

from __future__ import annotations

import pytest
import safetensors.torch
import torch

from diloco import DiLoCoWorker
from diloco.core.codecs import Int4Codec, Int8Codec, LowRankCodec, codec_by_name, codec_names
from diloco.core.fragments import Piece
from diloco.wire import build_layout, iter_body
from diloco.worker.settings import WorkerSettings, parse_codec, resolve, to_env
from diloco.worker.state.encoder import UploadEncoder, comm_dtype
from diloco.worker.state.local_model import LocalModel
from tests.helpers.codecs import make_model, worker

# --- choosing the codec -------------------------------------------------------------------------


def test_codec_names_and_options_parse() -> None:
    assert parse_codec("int8") == Int8Codec()
    assert parse_codec("int8:128") == Int8Codec(block=128)
    assert parse_codec("int4:block=32") == Int4Codec(block=32)
    assert parse_codec("lowrank") == LowRankCodec()
    assert parse_codec("lowrank:8") == LowRankCodec(rank=8)
    assert parse_codec("lowrank:rank=2,fallback=int4") == codec_by_name(
        "lowrank", rank=2, fallback="int4"
    )
    for name in codec_names():
        assert parse_codec(name).name == name


@pytest.mark.parametrize(
    "spec", ["int3", "int8:block=3", "lowrank:rank=x", "bf16:4", "lowrank:x=1"]
)
def test_a_bad_codec_is_a_value_error_at_construction(spec: str) -> None:
    with pytest.raises(ValueError, match="codec") as info:
        worker(codec=spec)
    if spec == "int3":
        assert "known codecs: fp32, bf16, int8, int4, lowrank" in str(info.value)


def test_bf16_comm_picks_the_codec_unless_one_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DILOCO_CODEC", raising=False)
    assert worker().codec_name == "bf16"
    assert worker(bf16_comm=False).codec_name == "fp32"
    assert worker(bf16_comm=False, codec="int8").codec_name == "int8"  # the codec wins
    w = worker(codec="lowrank:8")
    assert w.codec == LowRankCodec(rank=8) and w._local.comm_dtype == "F32"
    assert comm_dtype(parse_codec("bf16")) == "BF16"


def test_diloco_codec_reaches_the_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve({}, {"DILOCO_CODEC": "int4"}).codec == "int4"
    assert resolve({"codec": "int8"}, {"DILOCO_CODEC": "int4"}).codec == "int8"
    assert to_env(WorkerSettings(codec="lowrank:8"))["DILOCO_CODEC"] == "lowrank:8"
    monkeypatch.setenv("DILOCO_CODEC", "int4")
    assert worker().codec == Int4Codec()






def test_lowrank_is_refused_with_streaming_fragments() -> None:
    with pytest.raises(ValueError, match="whole matrices"):
        worker(codec="lowrank", num_fragments=2, sync_every=4)
    assert worker(codec="int4", num_fragments=2, sync_every=4).codec_name == "int4"


def test_a_parameter_name_with_the_part_separator_needs_a_raw_codec() -> None:
    class Odd(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_parameter("w@scale", torch.nn.Parameter(torch.zeros(3)))

    model = Odd()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="contains '@'"):
        DiLoCoWorker(model, opt, "127.0.0.1:1", codec="int8")
    assert DiLoCoWorker(model, opt, "127.0.0.1:1", codec="bf16").codec_name == "bf16"


def test_sync_metrics_are_numbers_for_the_trainers() -> None:
    m = worker(codec="int8").sync_metrics
    assert {"last_bytes_up", "last_bytes_down", "residual_norm"} <= set(m)
    assert all(isinstance(v, int | float) and not isinstance(v, bool) for v in m.values())


# --- UploadEncoder on a model with a snapshot set by hand ---------------------------------------


def local_model(
    codec: str, error_feedback: bool = True
) -> tuple[LocalModel, UploadEncoder, dict[str, float]]:
    model = make_model()
    local = LocalModel(model, comm_dtype(parse_codec(codec)), {})
    gen = torch.Generator().manual_seed(1)
    local.snapshot = {
        n: p.detach() + torch.randn(p.shape, generator=gen) for n, p in local.params.items()
    }
    metrics: dict[str, float] = {"residual_norm": 0.0}
    return local, UploadEncoder(parse_codec(codec), local, metrics, error_feedback), metrics


def body_of(specs: list, produce: object, meta: dict[str, str]) -> bytes:
    layout = build_layout(specs, meta, ordered=True)
    return b"".join(bytes(c) for c in iter_body(layout, produce))  # type: ignore[arg-type]


def true_g(local: LocalModel) -> dict[str, torch.Tensor]:
    return {n: local.snapshot[n] - p.detach() for n, p in local.params.items()}


@pytest.mark.parametrize("codec", ["int8", "int4", "lowrank"])
def test_a_body_is_the_same_every_time_until_committed_and_then_the_residual_moves(
    codec: str,
) -> None:
    local, enc, metrics = local_model(codec)
    up = enc.model_upload()
    first = body_of(up.specs, up.produce, enc.metadata)
    assert body_of(up.specs, up.produce, enc.metadata) == first  # a retry: the same bytes
    assert enc.feedback is not None and enc.feedback.residuals == {}  # not counted yet
    up.commit()
    g = true_g(local)
    shapes = local.table()
    sent = {
        n: enc.codec.decode(parts, shapes[n]) for n, parts in _parts(first, enc, shapes).items()
    }
    for n in shapes:
        torch.testing.assert_close(sent[n] + enc.feedback.residuals[n], g[n])
    assert (
        metrics["residual_norm"] == pytest.approx(enc.residual_norm()) and enc.residual_norm() > 0
    )
    # The next upload is compensated: it sends g + e, so two uploads of g sum to 2g - e2.
    second = enc.model_upload()
    again = body_of(second.specs, second.produce, enc.metadata)
    residual_before = {n: e.clone() for n, e in enc.feedback.residuals.items()}
    assert again != first  # compensated by the residual (warm start too, for low rank)
    assert all(torch.equal(residual_before[n], e) for n, e in enc.feedback.residuals.items())


def _parts(body: bytes, enc: UploadEncoder, shapes: dict) -> dict[str, list[torch.Tensor]]:
    tensors = safetensors.torch.load(body)
    return {
        n: [tensors[n + p.suffix] for p in enc.codec.parts(shape)] for n, shape in shapes.items()
    }


def test_fragment_pieces_are_encoded_on_their_own_blocks() -> None:
    """Pieces that start inside a block of the parameter: each is its own flat tensor, and its
    range of the parameter's residual takes what it dropped."""
    local, enc, _ = local_model("int8")
    g = true_g(local)
    w = "0.weight"  # 1200 elements: pieces at 0, 100 (not a multiple of 64), 1000
    cuts = [0, 100, 1000, 1200]
    pieces = [
        Piece(f"{w}[{a}:{b}]", w, 0, a, b, (b - a,)) for a, b in zip(cuts, cuts[1:], strict=False)
    ]
    send = {p.wire_name: g[w].view(-1)[p.start : p.stop].clone() for p in pieces}
    up = enc.fragment_upload(pieces, send)
    assert [s.name for s in up.specs][:2] == [f"{w}[0:100]@scale", f"{w}[0:100]"]
    assert [s.shape for s in up.specs][:2] == [(2,), (100,)]
    body = body_of(up.specs, up.produce, enc.metadata)
    up.commit()
    tensors = safetensors.torch.load(body)
    assert enc.feedback is not None
    e = enc.feedback.residuals[w].view(-1)
    for p in pieces:
        parts = [tensors[p.wire_name + part.suffix] for part in enc.codec.parts((p.numel,))]
        got = enc.codec.decode(parts, (p.numel,)) + e[p.start : p.stop]
        torch.testing.assert_close(got, send[p.wire_name])
    assert enc.residual_norm() == pytest.approx(float(torch.linalg.vector_norm(e)), rel=1e-5)


def test_raw_codecs_send_todays_body_and_keep_no_residual() -> None:
    for codec, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        local, enc, _ = local_model(codec)
        up = enc.model_upload()
        assert enc.feedback is None and all(s.dtype == local.comm_dtype for s in up.specs)
        body = body_of(up.specs, up.produce, enc.metadata)
        up.commit()
        tensors = safetensors.torch.load(body)
        for n, t in true_g(local).items():
            assert tensors[n].dtype == dtype
            assert torch.equal(tensors[n], t.to(dtype))
        assert enc.residual_norm() == 0.0 and enc.state_dict() == {}


def test_state_dict_round_trip_and_a_residual_that_does_not_fit() -> None:
    local, enc, metrics = local_model("lowrank")
    up = enc.model_upload()
    body_of(up.specs, up.produce, enc.metadata)
    up.commit()
    state = enc.state_dict()
    assert any(k.startswith("residual/") for k in state) and any(
        k.startswith("codec/") for k in state
    )
    _, other, other_metrics = local_model("lowrank")
    other.load_state_dict(state)
    assert other.state_dict().keys() == state.keys()
    assert all(torch.equal(other.state_dict()[k], v) for k, v in state.items())
    assert other_metrics["residual_norm"] == pytest.approx(enc.residual_norm())
    with pytest.raises(ValueError, match="does not fit"):
        other.load_state_dict({"residual/0.weight": torch.zeros(3)})


# --- without error feedback ---------------------------------------------------------------------


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_without_error_feedback_each_body_is_the_pseudo_gradient_encoded_alone(codec: str) -> None:
    local, enc, metrics = local_model(codec, error_feedback=False)
    up = enc.model_upload()
    first = body_of(up.specs, up.produce, enc.metadata)
    up.commit()
    assert enc.feedback is None and enc.residual_norm() == 0.0 and enc.state_dict() == {}
    assert metrics["residual_norm"] == 0.0
    g, shapes = true_g(local), local.table()
    for n, parts in _parts(first, enc, shapes).items():
        alone = enc.codec.encode(g[n], n)
        assert all(torch.equal(a, b) for a, b in zip(parts, alone, strict=True))
        assert not torch.equal(enc.codec.decode(parts, shapes[n]), g[n])  # lossy: something dropped
    # Nothing owed: the same model sends the same body again, uncompensated.
    second = enc.model_upload()
    assert body_of(second.specs, second.produce, enc.metadata) == first
    second.commit()
    assert enc.residual_norm() == 0.0 and enc.state_dict() == {}


def test_without_error_feedback_fragment_pieces_are_encoded_alone() -> None:
    local, enc, _ = local_model("int8", error_feedback=False)
    w = "0.weight"
    pieces = [Piece(f"{w}[{a}:{b}]", w, 0, a, b, (b - a,)) for a, b in ((0, 100), (100, 1200))]
    send = {p.wire_name: true_g(local)[w].view(-1)[p.start : p.stop].clone() for p in pieces}
    up = enc.fragment_upload(pieces, send)
    tensors = safetensors.torch.load(body_of(up.specs, up.produce, enc.metadata))
    up.commit()
    for p in pieces:
        parts = [tensors[p.wire_name + part.suffix] for part in enc.codec.parts((p.numel,))]
        alone = enc.codec.encode(send[p.wire_name])
        assert all(torch.equal(a, b) for a, b in zip(parts, alone, strict=True))
    assert enc.residual_norm() == 0.0 and enc.state_dict() == {}


def test_lowrank_without_error_feedback_still_warm_starts_q(
    caplog: pytest.LogCaptureFixture,
) -> None:
    local, enc, _ = local_model("lowrank", error_feedback=False)
    _, with_feedback, _ = local_model("lowrank")
    up, same = enc.model_upload(), with_feedback.model_upload()
    first = body_of(up.specs, up.produce, enc.metadata)
    assert body_of(same.specs, same.produce, enc.metadata) == first  # nothing owed yet either way
    up.commit()
    state = enc.state_dict()
    assert state and all(k.startswith("codec/") for k in state)  # Q kept, no residual
    assert enc.residual_norm() == 0.0
    # The next body starts its power iteration from the kept Q: not the first body again.
    second = enc.model_upload()
    again = body_of(second.specs, second.produce, enc.metadata)
    assert again != first
    # A worker resumed from the saved state sends what this one would (same g, same Q).
    _, resumed, _ = local_model("lowrank", error_feedback=False)
    resumed.load_state_dict(state)
    third = resumed.model_upload()
    assert body_of(third.specs, third.produce, resumed.metadata) == again
    # A checkpoint of a worker with feedback: its residual is dropped, its Q kept.
    with_state = {"residual/0.weight": torch.ones(30, 40), **state}
    _, other, other_metrics = local_model("lowrank", error_feedback=False)
    with caplog.at_level("WARNING", logger="diloco"):
        other.load_state_dict(with_state)
    assert "without error feedback keeps no residual" in caplog.text
    assert other.state_dict().keys() == state.keys() and other_metrics["residual_norm"] == 0.0
