"""Compressed uploads (issue 18) through a real server on loopback: int8, int4 and low-rank bodies
built here with core.codecs close sync rounds, async updates and fragment rounds to the outer step
of the mean of the decoded pseudo-gradients (computed here, not by the server's code); bad codecs
and bad parts are refused with their status and change nothing; and /status, /metrics show the
codecs and the bytes of a round."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import pytest
import requests
import safetensors.torch
import torch

from diloco.core.codecs import (
    Codec,
    Encoded,
    TopKCodec,
    codec_by_name,
    codec_metadata,
    decode_named,
    encode_named,
)
from diloco.server.observe.status import Status
from diloco.server.server import DiLoCoServer
from diloco.wire import encode
from tests.helpers import topk_records as records
from tests.helpers.codecs import SHAPES, grads, in_order, model, wait_status
from tests.helpers.fragments import FRAG2, in_fragment
from tests.helpers.http import (
    EXACT,
    TIMEOUT,
    accept,
    assert_error,
    assert_params_equal,
    assert_unchanged,
    expected_exact,
    post_json,
    state,
    submit,
    url,
    wait_round,
)
from tests.helpers.servers import ServerFactory
from tests.helpers.status import assert_keys


def join(server: DiLoCoServer, worker_id: str, codec: Codec | None, **info: Any) -> Any:
    if codec is not None:
        info["codec"] = codec_metadata(codec)
    return post_json(server, "/register", {"worker_id": worker_id, "info": info})


def joined(server: DiLoCoServer, worker_id: str, codec: Codec | None, **info: Any) -> Any:
    resp = join(server, worker_id, codec, **info)
    assert resp.status_code == 200, resp.text
    return resp.json()


def codec_body(
    worker_id: str,
    base: int,
    sid: str,
    codec: Codec,
    wire: Mapping[str, torch.Tensor],
    *,
    ordered: bool = False,
    extra: Mapping[str, str] | None = None,
) -> bytes:
    meta = {
        "worker_id": worker_id,
        "base_round": str(base),
        "submission_id": sid,
        **codec_metadata(codec),
        **(extra or {}),
    }
    return in_order(wire, meta) if ordered else encode(wire, meta)


def sums(server: DiLoCoServer) -> tuple[int, float, list[torch.Tensor]]:
    """The first unit's running sum: count, total weight and (a copy of) its tensors."""

    async def get() -> tuple[int, float, list[torch.Tensor]]:
        wsum = server.front.units[0].sum
        return wsum.count, wsum.total_weight, [t.clone() for t in wsum.sums]

    return server._call(get())


@pytest.fixture
def no_full_decode(monkeypatch: pytest.MonkeyPatch) -> Callable[[], None]:
    """Call it after computing the references: from then on, decoding an upload whole fails, so
    the server must have accumulated it chunk by chunk (``Codec.add_into``)."""

    def forbid() -> None:
        def fail(*args: object, **kwargs: object) -> torch.Tensor:
            raise AssertionError("an upload was decoded whole on the server")

        monkeypatch.setattr(Codec, "decode", fail)
        monkeypatch.setattr(Encoded, "decode", fail)

    return forbid


# --- sync rounds ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "options", "ordered"),
    [
        ("int8", {}, False),
        ("int4", {}, True),
        ("lowrank", {"rank": 4}, False),
        ("lowrank", {"rank": 2, "fallback": "int4"}, True),
        ("topk", {"density": 0.05, "chunk": 64, "bits": 2}, True),
    ],
)
def test_two_workers_close_a_round_to_the_mean_of_the_decoded(
    make_server: ServerFactory,
    no_full_decode: Callable[[], None],
    name: str,
    options: dict[str, Any],
    ordered: bool,
) -> None:
    server = make_server(model(), num_workers=2, **EXACT)
    codecs = {w: codec_by_name(name, **dict(options)) for w in "ab"}  # each its own warm start
    for w, codec in codecs.items():
        reply = joined(server, w, codec)
        assert name in reply["codecs"]
    old = server.global_params()
    wire = {w: encode_named(codecs[w], grads(i)) for i, w in enumerate("ab")}
    decoded = [decode_named(codecs[w], wire[w], SHAPES) for w in "ab"]
    if name == "lowrank":
        assert wire["a"]["w"].shape == (64, options["rank"])  # the matrix did go as factors
    no_full_decode()
    bodies = {w: codec_body(w, 0, f"{w}-0", codecs[w], wire[w], ordered=ordered) for w in "ab"}
    for w in "ab":
        assert safetensors.torch.load(bodies[w]).keys() == wire[w].keys()  # opens as safetensors
        accept(server, bodies[w])
    st = wait_round(server, 1)
    assert_params_equal(server.global_params(), expected_exact(old, *decoded))
    assert {w["worker_id"]: w["codec"] for w in st["workers"]} == {"a": name, "b": name}
    assert st["codecs"] == [name] and name in st["allowed_codecs"]
    assert st["last_round_bytes_in"] == sum(len(b) for b in bodies.values()) == st["bytes_in"]
    assert st["update_log"][-1]["round_bytes_in"] == st["last_round_bytes_in"]
    assert_keys(Status, st)
    assert Status.from_json(st).to_json() == st
    metrics = requests.get(url(server, "/metrics"), timeout=TIMEOUT).text
    assert f'diloco_workers_by_codec{{codec="{name}"}} 2' in metrics
    assert f'diloco_round_bytes{{direction="up"}} {st["last_round_bytes_in"]}' in metrics


def test_bytes_down_per_round_count_the_downloads(make_server: ServerFactory) -> None:
    server = make_server(model(), num_workers=1, **EXACT)
    codec = codec_by_name("int8")
    joined(server, "a", codec)
    sent = 0
    for r in range(2):
        resp = requests.get(
            url(server, f"/global_params?worker_id=a&min_round={r}"), timeout=TIMEOUT
        )
        assert resp.status_code == 200
        sent += len(resp.content)
        wait_status(
            server, lambda st, sent=sent: st["bytes_out"] == sent
        )  # counted once sent whole
        accept(server, codec_body("a", r, f"a-{r}", codec, encode_named(codec, grads(r))))
        st = wait_round(server, r + 1)
    # Round 1's period: one download of the parameters of round 1.
    assert st["last_round_bytes_out"] == len(resp.content)
    metrics = requests.get(url(server, "/metrics"), timeout=TIMEOUT).text
    assert f'diloco_round_bytes{{direction="down"}} {len(resp.content)}' in metrics


def test_a_plain_codec_body_is_taken_as_raw_values(make_server: ServerFactory) -> None:
    """bf16 and fp32 named as codecs are today's raw bodies, the first write included."""
    server = make_server(model(), num_workers=2, **EXACT)
    old = server.global_params()
    g = [grads(1), grads(2)]
    for w, name in zip("ab", ("bf16", "fp32"), strict=True):
        joined(server, w, codec_by_name(name))
    bf16 = codec_by_name("bf16")
    accept(server, codec_body("a", 0, "a-0", bf16, encode_named(bf16, g[0])))
    fp32 = codec_by_name("fp32")
    accept(server, codec_body("b", 0, "b-0", fp32, encode_named(fp32, g[1])))
    st = wait_round(server, 1)
    bf16_values = {n: t.to(torch.bfloat16) for n, t in g[0].items()}
    assert_params_equal(server.global_params(), expected_exact(old, bf16_values, g[1]))
    assert st["codecs"] == ["bf16", "fp32"]


def test_robust_aggregation_keeps_decoded_uploads(make_server: ServerFactory) -> None:
    server = make_server(model(), num_workers=2, clip_norm_factor=100.0, **EXACT)
    codec = codec_by_name("int8")
    for w in "ab":
        joined(server, w, codec)
    old = server.global_params()
    wire = [encode_named(codec, grads(i)) for i in range(2)]
    for i, w in enumerate("ab"):
        accept(server, codec_body(w, 0, f"{w}-0", codec, wire[i]))
    wait_round(server, 1)
    want = expected_exact(old, *(decode_named(codec, x, SHAPES) for x in wire))
    got = server.global_params()
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-6, atol=1e-7)


# --- async and fragments -------------------------------------------------------------------------


def test_async_applies_codec_uploads(
    make_server: ServerFactory, no_full_decode: Callable[[], None]
) -> None:
    server = make_server(model(), mode="async", num_workers=2, **EXACT)
    codecs = {"a": codec_by_name("int8"), "b": codec_by_name("lowrank", rank=2)}
    for w, codec in codecs.items():
        joined(server, w, codec)
    old = server.global_params()
    wire = {w: encode_named(codecs[w], grads(i)) for i, w in enumerate("ab")}
    decoded = {w: decode_named(codecs[w], wire[w], SHAPES) for w in "ab"}
    no_full_decode()
    ra = accept(server, codec_body("a", 0, "a-0", codecs["a"], wire["a"]))
    rb = accept(server, codec_body("b", 0, "b-0", codecs["b"], wire["b"]))
    assert (ra["version"], rb["version"], rb["staleness"]) == (1, 2, 1)
    got = server.global_params()
    for n, p in old.items():  # lr 1, no momentum: each arrival subtracts its pseudo-gradient
        torch.testing.assert_close(got[n], p - decoded["a"][n] - decoded["b"][n], rtol=0, atol=1e-6)
    st = server.status()
    assert st["codecs"] == ["int8", "lowrank"]
    assert st["update_log"][-1]["round_bytes_in"] > 0


def test_fragment_rounds_take_codec_pieces(
    make_server: ServerFactory, no_full_decode: Callable[[], None]
) -> None:
    server = make_server(model(), num_workers=2, poll_timeout=0.2, **EXACT)
    codec = codec_by_name("int4")
    ra = joined(server, "a", codec, **FRAG2)
    joined(server, "b", codec, **FRAG2)
    old = server.global_params()
    full = [grads(1), grads(2)]
    pieces = [
        {
            wire: g[param].reshape(-1)[start:stop].clone()
            for wire, param, start, stop in ra["fragments"][0]
        }
        for g in full
    ]
    wire = [encode_named(codec, p) for p in pieces]
    shapes = {name: tuple(t.shape) for name, t in pieces[0].items()}
    decoded = [decode_named(codec, x, shapes) for x in wire]
    no_full_decode()
    for i, w in enumerate("ab"):
        reply = accept(server, codec_body(w, 0, f"{w}-f0", codec, wire[i], extra={"fragment": "0"}))
        assert reply["fragment"] == 0
    assert [f["round"] for f in wait_fragment(server, 0, 1)["fragments"]] == [1, 0]
    got = server.global_params()
    for wire_name, param, start, stop in ra["fragments"][0]:
        mean = (decoded[0][wire_name] + decoded[1][wire_name]) / 2
        want = old[param].reshape(-1)[start:stop] - mean
        torch.testing.assert_close(got[param].reshape(-1)[start:stop], want, rtol=0, atol=1e-6)
    for name, p in old.items():  # fragment 1's elements are untouched
        untouched = ~in_fragment(ra, 0, name, p.shape)
        assert torch.equal(got[name][untouched], p[untouched])


def wait_fragment(server: DiLoCoServer, k: int, n: int) -> dict[str, Any]:
    resp = requests.get(
        url(server, f"/global_params?fragment={k}&min_round={n}&worker_id=a"), timeout=TIMEOUT
    )
    assert resp.status_code == 200
    return server.status()


# --- bad input -----------------------------------------------------------------------------------


def test_registration_refuses_unknown_bad_and_disallowed_codecs(make_server: ServerFactory) -> None:
    server = make_server(model(), num_workers=2, codecs="bf16,int8")
    joined(server, "a", codec_by_name("int8"))
    before = state(server)
    cases: list[tuple[Any, int, str]] = [
        ({"codec": "zstd"}, 400, "unknown_codec"),
        ({"codec": "int8", "codec_block": "3"}, 400, "bad_option"),
        ({"codec": "int8", "codec_block": "x"}, 400, "bad_option"),
        ({"codec": "lowrank", "codec_fallback": "lowrank"}, 400, "bad_option"),
        ({"codec_block": "64"}, 400, "bad_field"),
        ("int8", 400, "bad_field"),
        ({"codec": "int4"}, 422, "codec_refused"),
    ]
    for info_codec, status, code in cases:
        resp = post_json(server, "/register", {"worker_id": "b", "info": {"codec": info_codec}})
        reply = assert_error(resp, status, code)
        if code == "codec_refused":
            assert reply["allowed"] == ["bf16", "int8"] and "int4" in reply["detail"]
    assert_unchanged(before, server)
    joined(server, "b", codec_by_name("bf16"))  # one it takes still registers
    # Without a codec a worker uploads raw fp32/bf16: refused where neither is allowed.
    only_int8 = make_server(model(), codecs="int8")
    assert_error(join(only_int8, "c", None), 422, "codec_refused")
    assert only_int8.status()["workers"] == []


def _scale(value: float) -> Callable[[dict[str, torch.Tensor]], None]:
    def poison(wire: dict[str, torch.Tensor]) -> None:
        wire["w@scale"][3] = value

    return poison


BAD_UPLOADS: dict[
    str, tuple[Callable[[dict[str, torch.Tensor]], None], dict[str, str], int, str]
] = {
    "unknown_codec": (lambda w: None, {"codec": "zstd"}, 400, "unknown_codec"),
    "bad_option": (lambda w: None, {"codec_block": "100"}, 400, "bad_option"),
    "disallowed_codec": (lambda w: None, {"codec": "int4"}, 422, "codec_refused"),
    "scale_wrong_shape": (
        lambda w: w.update({"w@scale": w["w@scale"][:-1].clone()}),
        {},
        400,
        "bad_shape",
    ),
    "codes_wrong_shape": (
        lambda w: w.update({"w": w["w"].reshape(-1).clone()}),
        {},
        400,
        "bad_shape",
    ),
    "codes_wrong_dtype": (
        lambda w: w.update({"w": w["w"].to(torch.int16)}),
        {},
        400,
        "bad_dtype",
    ),
    "scale_wrong_dtype": (
        lambda w: w.update({"b@scale": w["b@scale"].float()}),
        {},
        400,
        "bad_dtype",
    ),
    "missing_scale": (lambda w: w.pop("e@scale"), {}, 400, "missing_tensor"),
    "extra_tensor": (
        lambda w: w.update({"w@extra": torch.zeros(3, dtype=torch.bfloat16)}),
        {},
        400,
        "unknown_tensor",
    ),
    "raw_tensor_named_plainly": (
        lambda w: w.update({"b": torch.zeros(48)}),
        {},
        400,
        "bad_dtype",
    ),
    "nan_scale": (_scale(float("nan")), {}, 422, "non_finite"),
    "inf_scale": (_scale(float("inf")), {}, 422, "non_finite"),
    "scale_decodes_past_fp32": (_scale(3e38), {}, 422, "non_finite"),
    "negative_scale": (_scale(-1.0), {}, 400, "bad_scale"),
}


@pytest.mark.parametrize("case", sorted(BAD_UPLOADS))
def test_bad_codec_uploads_change_nothing(make_server: ServerFactory, case: str) -> None:
    server = make_server(model(), num_workers=2, codecs="bf16,int8", **EXACT)
    codec = codec_by_name("int8")
    joined(server, "a", codec)
    joined(server, "b", codec)
    old = server.global_params()
    g = [grads(1), grads(2)]
    accept(server, codec_body("a", 0, "a-0", codec, encode_named(codec, g[0])))
    before, sum_before = state(server), sums(server)
    poison, meta, status, code = BAD_UPLOADS[case]
    wire = encode_named(codec, g[1])
    poison(wire)
    reply = assert_error(
        submit(server, codec_body("b", 0, "b-0", codec, wire, extra=meta)), status, code
    )
    if code in ("bad_shape", "bad_dtype", "bad_scale", "non_finite"):
        assert "parameter '" in reply["detail"], reply  # names the tensor
    assert_unchanged(before, server)
    count, total, after = sums(server)
    assert (count, total) == sum_before[:2] == (1, 1.0)
    for a, b in zip(after, sum_before[2], strict=True):
        assert torch.equal(a, b)
    # The same worker's good upload still counts, and closes the round exactly.
    good = encode_named(codec, g[1])
    accept(server, codec_body("b", 0, "b-0", codec, good))
    wait_round(server, 1)
    decoded = [
        decode_named(codec, encode_named(codec, g[0]), SHAPES),
        decode_named(codec, good, SHAPES),
    ]
    assert_params_equal(server.global_params(), expected_exact(old, *decoded))


def test_bad_low_rank_factors_are_refused(make_server: ServerFactory) -> None:
    server = make_server(model(), num_workers=1)
    codec = codec_by_name("lowrank", rank=2)
    joined(server, "a", codec)
    before = state(server)
    for value, status in ((float("nan"), 422), (float("inf"), 422), (1e30, 422)):
        wire = encode_named(codec, grads(1))
        wire["w@q"][0, 0] = value
        assert_error(submit(server, codec_body("a", 0, "a-0", codec, wire)), status, "non_finite")
    wire = encode_named(codec, grads(1))
    wire["w"] = wire["w"][:, :1].clone()  # a rank-1 P under rank 2
    reply = assert_error(submit(server, codec_body("a", 0, "a-0", codec, wire)), 400, "bad_shape")
    assert "'w'" in reply["detail"] and "(64, 2)" in reply["detail"]
    assert_unchanged(before, server)


def test_raw_uploads_are_refused_where_no_raw_codec_is_allowed(make_server: ServerFactory) -> None:
    server = make_server(model(), num_workers=1, codecs="fp32,int8")
    joined(server, "a", codec_by_name("int8"))
    before = state(server)
    raw = {n: t.to(torch.bfloat16) for n, t in grads(1).items()}
    meta = {"worker_id": "a", "base_round": "0", "submission_id": "a-0", "codec": "raw"}
    reply = assert_error(submit(server, encode(raw, meta)), 422, "codec_refused")
    assert "bf16" in reply["detail"]
    assert_unchanged(before, server)
    accept(server, encode(grads(1), meta))  # raw fp32 is allowed


def test_server_codecs_flag_is_validated() -> None:
    from diloco.server.config import ServerConfig

    assert ServerConfig().allowed_codecs == ("fp32", "bf16", "int8", "int4", "lowrank", "topk")
    assert ServerConfig(codecs=" int8 , bf16").allowed_codecs == ("int8", "bf16")
    for bad in ("", "int8,zstd", " , "):
        with pytest.raises(ValueError, match="codecs"):
            ServerConfig(codecs=bad)


TOPK = {"density": 0.05, "chunk": 64, "bits": 2}  # "e": 78 chunks keeping 3, a last of 8 keeping 1


def _forge(name: str, change: Callable[[list[records.Record]], None], *, repack: bool = True):
    """Rewrite one field of tensor ``name``'s topk records (tests/helpers/topk_records.py)."""
    codec = TopKCodec(**TOPK)
    n = math.prod(SHAPES[name])

    def poison(wire: dict[str, torch.Tensor]) -> None:
        recs = records.read(codec, wire[name], n)
        change(recs)
        wire[name] = records.write(codec, recs, repack=repack)

    return poison


def _set(chunk: int, field: str, value: Any) -> Callable[[list[records.Record]], None]:
    def change(recs: list[records.Record]) -> None:
        if field == "scale":
            recs[chunk].scale = value
        else:
            recs[chunk].positions[value[0]] = value[1]

    return change


def _reverse_first(recs: list[records.Record]) -> None:
    recs[0].positions.reverse()


def _repeat_first(recs: list[records.Record]) -> None:
    recs[0].positions[1] = recs[0].positions[0]


def _padding_bit(recs: list[records.Record]) -> None:
    recs[0].packed[-1] |= 0x80  # three 6-bit positions fill 18 of the record's 24 bits


BAD_SPARSE: dict[str, tuple[Callable[[dict[str, torch.Tensor]], None], int, str]] = {
    # Positions are 6 bits at chunk 64: only a short chunk can be left (b: one of 48).
    "index_past_its_chunk": (_forge("b", _set(0, "pos", (1, 50))), 400, "bad_index"),
    "index_past_the_short_last_chunk": (_forge("e", _set(78, "pos", (0, 8))), 400, "bad_index"),
    "repeated_index": (_forge("b", _repeat_first), 400, "bad_index"),
    "unsorted_indices": (_forge("w", _reverse_first), 400, "bad_index"),
    "padding_bits_set": (_forge("w", _padding_bit, repack=False), 400, "bad_index"),
    "one_byte_too_many": (
        lambda w: w.update({"w": torch.cat([w["w"], w["w"][:1]])}),
        400,
        "bad_shape",
    ),
    "codes_truncated": (lambda w: w.update({"e": w["e"][:-1].clone()}), 400, "bad_shape"),
    "nan_scale": (_forge("e", _set(2, "scale", float("nan"))), 422, "non_finite"),
    "negative_scale": (_forge("w", _set(0, "scale", -1.0)), 400, "bad_scale"),
}


@pytest.mark.parametrize("case", sorted(BAD_SPARSE))
def test_bad_sparse_uploads_change_nothing(make_server: ServerFactory, case: str) -> None:
    """Issue 30: a malformed top-k body is refused with its code before any value is added."""
    server = make_server(model(), num_workers=2, **EXACT)
    codec = codec_by_name("topk", **TOPK)
    for w in "ab":
        joined(server, w, codec)
    accept(server, codec_body("a", 0, "a-0", codec, encode_named(codec, grads(1))))
    before, sum_before = state(server), sums(server)
    poison, status, code = BAD_SPARSE[case]
    wire = encode_named(codec, grads(2))
    poison(wire)
    reply = assert_error(submit(server, codec_body("b", 0, "b-0", codec, wire)), status, code)
    assert "parameter '" in reply["detail"], reply  # names the tensor
    assert_unchanged(before, server)
    count, total, after = sums(server)
    assert (count, total) == sum_before[:2] == (1, 1.0)
    assert all(torch.equal(a, b) for a, b in zip(after, sum_before[2], strict=True))


def test_a_topk_peer_from_before_packed_positions_is_refused_by_name(
    make_server: ServerFactory,
) -> None:
    """The wire stays one format: a worker whose topk metadata lacks ``codec_index_bits`` (uint16
    positions in three parts) is refused at registration and, had it registered, at its upload:
    400 ``bad_option`` naming the option, nothing counted."""
    server = make_server(model(), num_workers=2, **EXACT)
    codec = codec_by_name("topk", **TOPK)
    old = {k: v for k, v in codec_metadata(codec).items() if k != "codec_index_bits"}
    reply = post_json(server, "/register", {"worker_id": "old", "info": {"codec": old}})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"] == "bad_option" and "codec_index_bits" in reply.json()["detail"]
    for w in "ab":
        joined(server, w, codec)
    before, sum_before = state(server), sums(server)
    meta = {"worker_id": "b", "base_round": "0", "submission_id": "b-0", **old}
    reply = assert_error(
        submit(server, encode(encode_named(codec, grads(2)), meta)), 400, "bad_option"
    )
    assert "codec_index_bits" in reply["detail"]
    assert_unchanged(before, server)
    assert sums(server)[:2] == sum_before[:2] == (0, 0.0)
